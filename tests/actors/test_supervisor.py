"""Restart strategies, restart types and restart intensity, checked event by event."""

import os
import time

import anyio
import pytest

from sonar.actors import ChildSpec, SiblingRef, SupervisorGaveUp, SupervisorSpec, parse_placement, runners, supervise
from tests.actors.helpers import alive, wait_for
from tests.actors.sample import Add, AskPeers, Crash, Echo, Quit, Sample, Whoami

pytestmark = pytest.mark.anyio


def three(placement, strategy, **sup_kwargs):
    children = [ChildSpec(n, Sample, placement=placement, ping_interval=None) for n in "abc"]
    return SupervisorSpec("root", children, strategy=strategy, **sup_kwargs)


def after_crash(sup):
    events = [(e.kind, e.child) for e in sup.events]
    return events[events.index(("crash", "b")) :]


async def crash_b_and_settle(sup, expected_events: int):
    pids = {n: sup.child(n).pid for n in "abc"}
    await sup.child("b").ref.send(Crash())
    await wait_for(
        lambda: (
            ("crash", "b") in [(e.kind, e.child) for e in sup.events]
            and len(after_crash(sup)) >= expected_events
            and all(sup.child(n).state == "running" for n in "abc")
        )
    )
    for n in "abc":  # everyone answers after the restarts
        assert await sup.child(n).ref.ask(Echo(n), timeout=5) == n
    return pids


async def test_one_for_one_restarts_only_the_crashed_child(placement):
    async with supervise(three(placement, "one_for_one")) as sup:
        pids = await crash_b_and_settle(sup, 3)
        assert after_crash(sup) == [("crash", "b"), ("restart", "b"), ("start", "b")]
        assert [sup.child(n).restarts for n in "abc"] == [0, 1, 0]
        assert sup.child("a").pid == pids["a"] and sup.child("c").pid == pids["c"]


async def test_one_for_all_stops_the_others_in_reverse_and_restarts_all_in_order(placement):
    async with supervise(three(placement, "one_for_all")) as sup:
        await crash_b_and_settle(sup, 9)
        assert after_crash(sup) == [
            ("crash", "b"),
            ("stop", "c"),
            ("stop", "a"),
            ("restart", "a"),
            ("start", "a"),
            ("restart", "b"),
            ("start", "b"),
            ("restart", "c"),
            ("start", "c"),
        ]
        assert [sup.child(n).restarts for n in "abc"] == [1, 1, 1]
        started = [sup.child(n).started_at for n in "abc"]
        assert started == sorted(started)


async def test_rest_for_one_restarts_the_crashed_child_and_those_after_it(placement):
    async with supervise(three(placement, "rest_for_one")) as sup:
        pids = await crash_b_and_settle(sup, 6)
        assert after_crash(sup) == [
            ("crash", "b"),
            ("stop", "c"),
            ("restart", "b"),
            ("start", "b"),
            ("restart", "c"),
            ("start", "c"),
        ]
        assert [sup.child(n).restarts for n in "abc"] == [0, 1, 1]
        assert sup.child("a").pid == pids["a"]


async def test_transient_child_is_restarted_only_after_an_abnormal_exit(placement):
    spec = SupervisorSpec(
        "root",
        [
            ChildSpec("t", Sample, placement=placement, restart="transient", ping_interval=None),
        ],
    )
    async with supervise(spec) as sup:
        t = sup.child("t")
        await t.ref.send(Crash())
        await wait_for(lambda: t.restarts == 1 and t.state == "running")
        await t.ref.send(Quit())
        await wait_for(lambda: t.state == "stopped")
        await anyio.sleep(0.3)
        assert t.restarts == 1 and t.state == "stopped"
        assert [(e.kind, e.child) for e in sup.events][-1] == ("exit", "t")


async def test_temporary_child_is_never_restarted(placement):
    spec = SupervisorSpec(
        "root",
        [
            ChildSpec("keep", Sample, placement=placement, ping_interval=None),
            ChildSpec("tmp", Sample, placement=placement, restart="temporary", ping_interval=None),
        ],
    )
    async with supervise(spec) as sup:
        tmp = sup.child("tmp")
        await tmp.ref.send(Crash())
        await wait_for(lambda: [r.name for r in sup.runners] == ["keep"])
        await anyio.sleep(0.3)
        assert tmp.restarts == 0
        assert [c.name for c in sup.tree().children] == ["keep"]


async def test_slow_starts_do_not_hide_a_crash_loop():
    """Each restart takes 0.4 s, longer than the 0.3 s period: the intensity clock leaves start
    time out, so three quick crashes still make the supervisor give up."""
    spec = SupervisorSpec("root", [ChildSpec("slow", Sample, kwargs={"start_delay": 0.4})], max_restarts=2, period=0.3)
    with pytest.raises(SupervisorGaveUp, match="3 restarts within 0.3"):
        async with supervise(spec) as sup:
            slow = sup.child("slow")
            for crash in range(3):
                await wait_for(lambda: slow.state == "running" and slow.restarts == crash)
                await slow.ref.send(Crash())
            await anyio.sleep(30)  # cancelled when the supervisor gives up


async def test_intensity_exceeded_stops_children_and_fails_upward(placement):
    spec = three(placement, "one_for_one", max_restarts=2, period=30)
    pids: list[int] = []
    with pytest.raises(SupervisorGaveUp, match="3 restarts within 30"):
        async with supervise(spec) as sup:
            pids += [sup.child(n).pid for n in "abc"]
            b = sup.child("b")
            for crash in range(3):
                await wait_for(lambda: b.state == "running" and b.restarts == crash)
                pids.append(b.pid)
                await b.ref.send(Crash())
            await anyio.sleep(30)  # cancelled when the supervisor gives up
    events = [(e.kind, e.child) for e in sup.events]
    assert events[-3:] == [("give_up", "b"), ("stop", "c"), ("stop", "a")]
    assert events.count(("restart", "b")) == 2
    assert all(r.state in ("stopped", "crashed") for r in sup.runners)
    await wait_for(lambda: not any(alive(p) for p in set(pids) if p != os.getpid()), timeout=5)


async def test_nested_supervisor_gives_up_and_its_parent_restarts_it(placement):
    inner = SupervisorSpec(
        "inner",
        [
            ChildSpec("x", Sample, placement=placement, ping_interval=None),
            ChildSpec("y", Sample, placement=placement, ping_interval=None),
        ],
        max_restarts=0,
    )
    spec = SupervisorSpec(
        "root",
        [ChildSpec("top", Sample, placement=placement, ping_interval=None), inner],
        strategy="one_for_one",
        max_restarts=3,
        period=30,
    )
    async with supervise(spec) as sup:
        tree = sup.tree()
        assert [c.name for c in tree.children] == ["top", "inner"]
        assert [c.name for c in tree.find("inner").children] == ["x", "y"]
        runner = sup.child("inner")
        x_pid = runner.child.child("x").pid
        await runner.child.child("x").ref.send(Crash())
        await wait_for(lambda: runner.restarts == 1 and runner.state == "running")
        assert [(e.kind, e.child) for e in sup.events][-3:] == [
            ("crash", "inner"),
            ("restart", "inner"),
            ("start", "inner"),
        ]
        x = runner.child.child("x")
        assert await x.ref.ask(Echo("back"), timeout=5) == "back"
        assert sup.tree().find("inner").state == "running"
        if placement.__class__.__name__ == "ChildProcess":
            assert x.pid != x_pid and not alive(x_pid)


async def test_failed_start_stops_the_children_already_started(placement):
    spec = SupervisorSpec(
        "root",
        [
            ChildSpec("ok", Sample, placement=placement, ping_interval=None),
            ChildSpec("bad", Sample, kwargs={"fail_start": True}, placement=placement, ping_interval=None),
        ],
    )
    with pytest.raises(Exception, match="refusing to start|before it was ready|exited with code"):
        async with supervise(spec):
            pass


async def test_two_trees_can_each_have_a_child_of_the_same_name(placement):
    def spec():
        return SupervisorSpec("root", [ChildSpec("a", Sample, placement=placement, ping_interval=None)])

    async with supervise(spec()) as one, supervise(spec()) as two:
        a1, a2 = one.child("a").ref, two.child("a").ref
        assert a1 != a2
        assert await a1.ask(Add(1), timeout=5) == [1]
        assert await a2.ask(Add(2), timeout=5) == [2]
        assert await a1.ask(Add(3), timeout=5) == [1, 3]


async def test_sibling_paths_reach_into_and_out_of_a_nested_supervisor_across_its_restarts(placement):
    """A nested group's child names its parent's later sibling (``../``) and a list of siblings; a
    later sibling of the group names a child inside it (``group/child``). The group's children keep
    their references when it restarts them all, so the outside sibling reaches the new run."""
    group = SupervisorSpec(
        "group",
        [
            ChildSpec("a", Sample, placement=placement, ping_interval=None),
            ChildSpec(
                "lead",
                Sample,
                kwargs={"peers": [SiblingRef("a"), SiblingRef("../c")]},
                placement=placement,
                ping_interval=None,
            ),
        ],
        strategy="one_for_all",
    )
    spec = SupervisorSpec(
        "root",
        [
            group,
            ChildSpec("c", Sample, placement=placement, ping_interval=None),
            ChildSpec(
                "d", Sample, kwargs={"peers": [SiblingRef("group/lead")]}, placement=placement, ping_interval=None
            ),
        ],
    )
    async with supervise(spec) as sup:
        inner = sup.child("group").child
        peers = await inner.child("lead").ref.ask(AskPeers(), timeout=10)
        assert [p["pid"] for p in peers] == [inner.child("a").pid, sup.child("c").pid]
        (before,) = await sup.child("d").ref.ask(AskPeers(), timeout=10)
        assert before["pid"] == inner.child("lead").pid
        await inner.child("a").ref.send(Crash())
        await wait_for(lambda: inner.child("lead").restarts == 1 and inner.child("lead").state == "running")
        assert sup.child("group").child is inner
        (after,) = await sup.child("d").ref.ask(AskPeers(), timeout=10)
        assert after["pid"] == inner.child("lead").pid
        assert await inner.child("lead").ref.ask(Whoami(), timeout=10) == after


async def test_children_started_together_start_at_once_and_restart_at_once(placement):
    """Two children that each take 2 s to start become ready within a moment of each other (in
    order, the second would be ready 2 s after the first), and the intensity clock counts their start
    once; under one_for_all a crash restarts both at once."""
    children = [
        ChildSpec(n, Sample, kwargs={"start_delay": 2.0}, placement=placement, ping_interval=None) for n in "ab"
    ]
    spec = SupervisorSpec("root", children, strategy="one_for_all", start_together=True)

    def ready_gap(sup) -> float:
        ready = {e.child: e.time for e in sup.events if e.kind == "start"}
        return abs(ready["a"] - ready["b"])

    began = time.monotonic()
    async with supervise(spec) as sup:
        assert ready_gap(sup) < 1.5
        first_start = sup._starting_seconds
        assert first_start <= time.monotonic() - began  # the two starts' time, counted once
        await sup.child("a").ref.send(Crash())
        await wait_for(
            lambda: all(sup.child(n).restarts == 1 and sup.child(n).state == "running" for n in "ab"), timeout=30
        )
        assert ready_gap(sup) < 1.5
        for n in "ab":
            assert await sup.child(n).ref.ask(Echo(n), timeout=5) == n


async def test_a_child_started_together_may_ask_a_sibling_whose_process_is_up_before_its_actor(monkeypatch):
    """`b`'s process binds its address before the actor in it is spawned; `a`, started at the same
    time, asks `b` in its own start. The message waits in `b`'s process for `b` (it was refused
    with `ActorNotFound` when it arrived in that gap, a failure seen in CI with tensor-parallel ranks)."""
    spawn = runners._HostedRunner._spawn

    async def late_for_b(self, incarnation: int, timeout: float) -> None:
        if self.name == "b":
            await anyio.sleep(3.0)
        await spawn(self, incarnation, timeout)

    monkeypatch.setattr(runners._HostedRunner, "_spawn", late_for_b)
    children = [
        ChildSpec("b", Sample, placement=parse_placement("process"), ping_interval=None),
        ChildSpec(
            "a",
            Sample,
            kwargs={"peers": [SiblingRef("b")], "greet_peers": True},
            placement=parse_placement("process"),
            ping_interval=None,
        ),
    ]
    async with supervise(SupervisorSpec("root", children, start_together=True)) as sup:
        [b] = await sup.child("a").ref.ask(AskPeers(), timeout=10)
        assert b == {"pid": sup.child("b").pid, "name": "b"}
