"""The engine gives the same output wherever its actors run, and leaves nothing behind.

(Tests that need an engine of their own live here too: two engines with in-process actors cannot
be open at once in one process, since actor names are per process, so `test_api.py`'s shared
engine rules them out there.)

Each placement opens its own engine on the real embedded model (float32, so the comparison can
be exact) and checks: greedy output identical to the in-process engine's, `llm.tree()` showing
the out-of-process actors in other processes, and after the `async with` block no child process,
no thread and no task left over.

Threads: anyio runs blocking calls (tokenizing, the in-process worker's forward passes, loading)
in its worker-thread pool, whose threads are named "AnyIO worker thread" and stay parked for up
to 10 s after their last job so the next call can reuse them; they belong to the event loop, not
to the engine, so they are left out of the comparison (their number is bounded by anyio's
default thread limiter). Every other Python thread must be gone within two seconds.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import anyio
import pytest

import sonar
from sonar import SamplingParams

pytestmark = pytest.mark.anyio

ENGINE = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=64)
PROMPTS = [
    "The capital of France is",
    "中文：你好世界 🌍🚀。English:",
    "Once upon a time, in a small village by the sea,",
]
PARAMS = SamplingParams(temperature=0, max_tokens=12)
ANYIO_THREAD = "AnyIO worker thread"


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
async def reference(one_thread) -> list[tuple[list[int], str]]:
    """Greedy outputs of the all-in-process engine."""
    async with sonar.open(**ENGINE) as llm:
        outs = await llm.generate_many(PROMPTS, PARAMS)
    assert all(len(o.token_ids) == PARAMS.max_tokens for o in outs)
    return [(o.token_ids, o.text) for o in outs]


def child_processes() -> dict[int, str]:
    """pid -> state of every process whose parent is this one (zombies included)."""
    me = os.getpid()
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == me:
            out[int(entry)] = fields[0]
    return out


def engine_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name != ANYIO_THREAD}


async def eventually(check: Any, timeout: float, what: str) -> None:
    with anyio.move_on_after(timeout):
        while not check():
            await anyio.sleep(0.05)
        return
    pytest.fail(f"{what} after {timeout} s")


@pytest.mark.parametrize(
    "placement, elsewhere",
    [
        ("worker=inprocess,detokenizer=inprocess,scheduler=inprocess", set()),
        ("worker=process", {"worker"}),
        ("worker=process,detokenizer=process", {"worker", "detokenizer"}),
    ],
)
async def test_same_output_and_nothing_left_behind(reference, placement, elsewhere):
    me = os.getpid()
    children_before = child_processes()
    threads_before = engine_threads()
    tasks_before = asyncio.all_tasks()

    async with sonar.open(placement=placement, **ENGINE) as llm:
        nodes = {c.name: c for c in llm.tree().children}
        assert set(nodes) == {"worker", "detokenizer", "scheduler"}
        for name, node in nodes.items():
            assert node.state == "running"
            if name in elsewhere:
                assert (node.placement, node.pid != me) == ("process", True), node
            else:
                assert (node.placement, node.pid) == ("inprocess", me), node
        assert llm.info.pid == nodes["worker"].pid
        spawned = {nodes[name].pid for name in elsewhere}
        assert spawned <= set(child_processes())

        outs = await llm.generate_many(PROMPTS, PARAMS)
        assert [(o.token_ids, o.text) for o in outs] == reference
        deltas = [d async for d in llm.stream(PROMPTS[1], PARAMS)]
        assert "".join(d.text for d in deltas) == reference[1][1]
        assert [t for d in deltas for t in d.token_ids] == reference[1][0]
        stats = await llm.stats()
        assert (stats.num_running, stats.num_waiting, stats.num_free_blocks) == (0, 0, llm.info.num_blocks)

    # The block has ended: the actor processes are gone (reaped, not zombies) ...
    await eventually(lambda: child_processes() == children_before, 5, "child processes are left")
    assert not any(os.path.exists(f"/proc/{pid}") for pid in spawned)
    # ... as are the engine's threads (anyio's idle pool threads aside, see the module doc) ...
    await eventually(lambda: engine_threads() <= threads_before, 2, "threads are left")
    # ... and its tasks.
    left = asyncio.all_tasks() - tasks_before
    assert not left, left
    # A closed handle refuses new work.
    with pytest.raises(sonar.EngineDeadError):
        await llm.generate("Hello", PARAMS)


async def test_preempted_request_resumes_with_the_same_output(one_thread):
    """A request preempted for want of KV blocks is recomputed: same tokens, and its prompt
    logprobs are sent once (not once per pass over the prompt)."""
    async with sonar.open(dtype="float32", max_model_len=128, num_gpu_blocks_override=8) as small:
        first = [504 + i % 37 for i in range(50)]  # 4 of the 8 blocks each
        second = [900 + i % 29 for i in range(50)]
        p_first = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        p_second = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=1)
        ref = await small.generate(second, p_second)
        results = {}

        async def run(name: str, ids: list[int], params: SamplingParams) -> None:
            results[name] = await small.generate(ids, params)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "first", first, p_first)
            with anyio.fail_after(20):  # admitted first, so it is the one that grows first
                while (await small.stats()).num_running < 1:
                    await anyio.sleep(0.01)
            tg.start_soon(run, "second", second, p_second)
        stats = await small.stats()
        assert stats.num_preemptions >= 1
        assert (stats.num_running, stats.num_waiting, stats.num_free_blocks) == (0, 0, small.info.num_blocks)
        out = results["second"]
        assert out.token_ids == ref.token_ids and out.text == ref.text
        assert len(out.prompt_logprobs) == len(second) and out.prompt_logprobs[0] is None
        assert [p.token_id for p in out.prompt_logprobs[1:]] == second[1:]
        assert [p.logprob for p in out.prompt_logprobs[1:]] == pytest.approx(
            [p.logprob for p in ref.prompt_logprobs[1:]], abs=1e-3
        )
        assert len(results["first"].token_ids) == 40


async def test_two_engines_in_one_process(reference, one_thread):
    """Actor names are qualified per tree: two engines (one with a child-process worker) run side
    by side in one event loop and each answers as an engine alone would."""
    async with sonar.open(**ENGINE) as one, sonar.open(placement="worker=process", **ENGINE) as two:
        assert one.info.pid == os.getpid() and two.info.pid != os.getpid()
        first, second = await asyncio.gather(one.generate_many(PROMPTS, PARAMS), two.generate_many(PROMPTS, PARAMS))
    assert [(o.token_ids, o.text) for o in first] == reference
    assert [(o.token_ids, o.text) for o in second] == reference


async def test_actors_on_an_authenticated_remote_host(reference, one_thread, tmp_path):
    """The worker and the detokenizer on an actor host reached over tcp with a deployment's keys
    (`python -m sonar actor keygen`, `--keys`; `configure_transport` here, as `serve --actor-keys`
    does): the same output, the detokenizer's outputs reaching this process's client actor over a
    link back, and nothing runs there for a supervisor without the keys."""
    import subprocess
    import sys

    from sonar.actors import configure_transport
    from tests.actors.helpers import free_tcp_address, stop_host

    keys_dir = tmp_path / "keys"
    subprocess.run([sys.executable, "-m", "sonar", "actor", "keygen", str(keys_dir)], check=True, capture_output=True)
    address = free_tcp_address()
    host = subprocess.Popen(
        [sys.executable, "-m", "sonar", "actor", "--listen", address, "--keys", str(keys_dir)],
        env=dict(os.environ, PYTHONPATH=os.getcwd()),
    )
    try:
        with pytest.raises(RuntimeError, match="needs the deployment's keys"):
            async with sonar.open(placement=f"worker={address}", **ENGINE):
                pass
        configure_transport(keys_dir)
        try:
            async with sonar.open(placement=f"worker={address},detokenizer={address}", **ENGINE) as llm:
                nodes = {c.name: c for c in llm.tree().children}
                assert (nodes["worker"].placement, nodes["worker"].pid) == (address, host.pid)
                outs = await llm.generate_many(PROMPTS, PARAMS)
            assert [(o.token_ids, o.text) for o in outs] == reference
        finally:
            configure_transport(None)
        assert host.poll() is None
    finally:
        stop_host(host)
