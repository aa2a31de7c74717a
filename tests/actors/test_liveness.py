"""Hung children, children that ignore stop, killed processes, and leftover processes."""

import os
import signal
import sys
import time

import anyio
import pytest

from sonar.actors import ActorError, ChildProcess, ChildSpec, SupervisorSpec, supervise
from tests.actors.helpers import alive, other_pids, wait_for
from tests.actors.sample import Echo, Freeze, Hang, Sample

pytestmark = pytest.mark.anyio


def is_process(placement) -> bool:
    return isinstance(placement, ChildProcess)


async def test_hung_child_is_detected_by_liveness_and_restarted(placement):
    spec = SupervisorSpec("root", [ChildSpec("a", Sample, placement=placement, ping_interval=0.2, ping_timeout=0.5)])
    async with supervise(spec) as sup:
        a = sup.child("a")
        old_pid = a.pid
        await a.ref.send(Hang())
        t0 = time.time()
        await wait_for(lambda: a.restarts == 1 and a.state == "running", timeout=10)
        hung = next(e for e in sup.events if e.kind == "hung")
        assert hung.time - t0 < 0.2 + 0.5 + 0.3  # within one ping interval plus the deadline
        kinds = [(e.kind, e.child) for e in sup.events]
        assert kinds[-4:] == [("hung", "a"), ("crash", "a"), ("restart", "a"), ("start", "a")]
        assert sup.events[-3].detail.startswith("hung")
        assert await a.ref.ask(Echo("back"), timeout=5) == "back"
        if is_process(placement):
            assert a.pid != old_pid and not alive(old_pid)


async def test_child_process_with_a_blocked_event_loop_is_killed_and_restarted():
    spec = SupervisorSpec(
        "root", [ChildSpec("a", Sample, placement=ChildProcess(), ping_interval=0.2, ping_timeout=0.5)]
    )
    async with supervise(spec) as sup:
        a = sup.child("a")
        old_pid = a.pid
        await a.ref.send(Freeze())  # time.sleep forever: nothing in that process runs any more
        await wait_for(lambda: a.restarts == 1 and a.state == "running", timeout=5)
        assert not alive(old_pid)
        assert await a.ref.ask(Echo("thawed"), timeout=5) == "thawed"


async def test_child_that_ignores_stop_is_killed_within_deadline_plus_one_second(placement):
    deadline = 0.5
    spec = SupervisorSpec(
        "root",
        [
            ChildSpec(
                "stubborn",
                Sample,
                kwargs={"ignore_stop": True},
                placement=placement,
                shutdown=deadline,
                ping_interval=None,
            )
        ],
    )
    async with supervise(spec) as sup:
        pid = sup.child("stubborn").pid
        assert await sup.child("stubborn").ref.ask(Echo("hi"), timeout=5) == "hi"
        t0 = time.monotonic()
    elapsed = time.monotonic() - t0
    assert elapsed < deadline + 1.0
    assert elapsed >= deadline * 0.9
    if is_process(placement):
        assert not alive(pid)


async def test_child_process_that_ignores_sigterm_is_sigkilled():
    deadline = 0.3
    spec = SupervisorSpec(
        "root",
        [
            ChildSpec(
                "deaf",
                Sample,
                kwargs={"ignore_stop": True, "ignore_sigterm": True},
                placement=ChildProcess(),
                shutdown=deadline,
                ping_interval=None,
            )
        ],
    )
    async with supervise(spec) as sup:
        pid = sup.child("deaf").pid
        assert await sup.child("deaf").ref.ask(Echo("hi"), timeout=5) == "hi"
        t0 = time.monotonic()
    elapsed = time.monotonic() - t0
    assert deadline + 0.9 <= elapsed < deadline + 1.0 + 1.0  # deadline, SIGTERM ignored for 1 s, SIGKILL
    assert not alive(pid)
    assert "stopped" == sup.child("deaf").state


async def test_sigkill_from_outside_is_detected_and_the_child_restarted():
    spec = SupervisorSpec("root", [ChildSpec("w", Sample, placement=ChildProcess(), ping_interval=None)])
    async with supervise(spec) as sup:
        w = sup.child("w")
        old = w.pid
        os.kill(old, signal.SIGKILL)
        await wait_for(lambda: w.restarts == 1 and w.state == "running", timeout=5)
        assert w.last_exit.reason == "killed by signal SIGKILL"
        assert w.pid != old and alive(w.pid)
        assert await w.ref.ask(Echo("again"), timeout=5) == "again"


async def test_no_child_process_is_left_after_shutdown():
    before = other_pids()
    spec = SupervisorSpec(
        "root",
        [ChildSpec(f"p{i}", Sample, placement=ChildProcess(), ping_interval=0.5) for i in range(3)]
        + [SupervisorSpec("inner", [ChildSpec("q", Sample, placement=ChildProcess())])],
    )
    async with supervise(spec) as sup:
        pids = {c.pid for c in sup.tree().children if c.kind == "actor"} | {sup.tree().find("q").pid}
        assert len(pids) == 4 and all(alive(p) for p in pids)
        assert other_pids() - before == pids
    assert not any(alive(p) for p in pids)
    assert other_pids() - before == set()


async def test_child_process_exits_when_its_parent_dies(tmp_path):
    """A child whose parent is SIGKILLed (no chance to stop it) exits on its own."""
    script = tmp_path / "parent.py"
    script.write_text(
        "import anyio, os, sys\n"
        "from sonar.actors import ChildProcess, ChildSpec, SupervisorSpec, supervise\n"
        "from tests.actors.sample import Sample\n"
        "async def main():\n"
        "    spec = SupervisorSpec('root', [ChildSpec('a', Sample, placement=ChildProcess())])\n"
        "    async with supervise(spec) as sup:\n"
        "        print(sup.child('a').pid, flush=True)\n"
        "        await anyio.sleep(60)\n"
        "anyio.run(main, backend='asyncio')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    async with await anyio.open_process([sys.executable, str(script)], env=env) as proc:
        line = b""
        with anyio.fail_after(20):
            while not line.endswith(b"\n"):
                line += await proc.stdout.receive(1)
        child = int(line)
        assert alive(child)
        proc.kill()
        await proc.wait()
    await wait_for(lambda: not alive(child), timeout=3)


async def test_an_ask_to_a_child_that_dies_fails_at_once_not_at_its_timeout(placement):
    """The asker (here, in the supervisor's process) learns of the death when the supervisor does."""
    spec = SupervisorSpec("root", [ChildSpec("a", Sample, placement=placement, ping_interval=None)])
    async with supervise(spec) as sup:
        a = sup.child("a")
        await a.ref.send(Hang())  # the next ask waits behind a handler that never returns
        t0 = time.monotonic()

        async def kill_soon() -> None:
            await anyio.sleep(0.3)
            if is_process(placement):
                os.kill(a.pid, signal.SIGKILL)
            else:
                await a.fail("killed by the test")

        async with anyio.create_task_group() as tg:
            tg.start_soon(kill_soon)
            with pytest.raises(ActorError, match="ended"):
                await a.ref.ask(Echo("never"), timeout=30)
        assert time.monotonic() - t0 < 3
        await wait_for(lambda: a.restarts == 1 and a.state == "running", timeout=10)
        assert await a.ref.ask(Echo("back"), timeout=5) == "back"
