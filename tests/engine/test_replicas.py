"""Data parallelism through the library (`sonar.open(data_parallel_size=2)`) on the embedded model:
the same greedy text as one engine, requests spread over the replicas, a shared prefix kept on one
replica, each worker on its own cores, and a killed or crashed replica leaving the other's requests
alone; plus the replicas' configurations and tree with plain values."""

from __future__ import annotations

import os
import signal

import anyio
import pytest

import sonar
from sonar import SamplingParams
from sonar.actors import ChildProcess, SupervisorSpec
from sonar.engine.config import EngineConfig
from sonar.engine.cores import cpu_share
from sonar.engine.replicas import data_parallel_spec, replica_config, replica_gpus

pytestmark = pytest.mark.anyio

ENGINE = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=64, seed=0)
PARAMS = SamplingParams(temperature=0, max_tokens=8)
LONG = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [
    "The capital of France is",
    "Two plus two equals",
    "My favourite animal is the",
    "Once upon a time, in a small village by the sea,",
    "The best way to learn a language is",
    "Water boils at",
]
#: Four full 16-token blocks and more: a prompt that starts with it reuses them where they are cached.
SHARED = (
    "You are a careful assistant. Answer in one short sentence, cite no sources, and never repeat the "
    "question. Keep a friendly tone and prefer plain words over jargon. When a question has no good "
    "answer, say so plainly and suggest where the reader could look instead. Use metric units, spell "
    "out numbers below ten, and do not use lists or headings. The question follows. "
)


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
async def reference(one_thread) -> dict[str, list[str]]:
    """What one engine answers (greedy), to compare the replicas with."""
    async with sonar.open(**ENGINE) as one:
        short = await one.generate_many(PROMPTS, PARAMS)
        long = await one.generate_many(PROMPTS[:4], LONG)
    return {"short": [o.text for o in short], "long": [o.text for o in long]}


@pytest.fixture(scope="module")
async def llm(reference):
    async with sonar.open(**ENGINE, data_parallel_size=2) as engine:
        yield engine


def replica_nodes(llm: sonar.LLM) -> list:
    return [c for c in llm.tree().children if c.name.startswith("replica")]


def worker_of(replica) -> object:
    return next(c for c in replica.children if c.name == "worker")


async def test_two_replicas_give_the_greedy_text_of_one_and_share_the_requests(llm, reference) -> None:
    before = await llm.replica_stats()
    outs = await llm.generate_many(PROMPTS, PARAMS)
    assert [o.text for o in outs] == reference["short"]
    after = await llm.replica_stats()
    served = [a.prefix_queries - b.prefix_queries for a, b in zip(after, before)]
    assert all(n > 0 for n in served), served  # both replicas computed prompts
    assert sum(llm.router.stats.routed) >= len(PROMPTS) and min(llm.router.stats.routed) >= 2
    assert await llm.tracked_requests() == {"frontend": 0, "scheduler": 0, "detokenizer": 0}
    assert llm.router.in_flight == [0, 0]
    total = await llm.stats()
    assert total.prefix_queries == sum(s.prefix_queries for s in after)
    assert total.num_free_blocks == 2 * llm.info.num_blocks


async def test_each_replica_is_a_whole_engine_with_its_worker_on_its_own_cores(llm) -> None:
    replicas = replica_nodes(llm)
    assert [r.name for r in replicas] == ["replica0", "replica1"]
    cores = sorted(os.sched_getaffinity(0))
    pids = set()
    for index, replica in enumerate(replicas):
        assert {c.name for c in replica.children} == {"worker", "detokenizer", "scheduler"}
        worker = worker_of(replica)
        assert worker.placement == "process" and worker.pid != os.getpid()
        assert os.sched_getaffinity(worker.pid) == set(cpu_share(index, 2, cores))
        pids.add(worker.pid)
    assert len(pids) == 2
    await llm.ping()


async def test_a_shared_prefix_stays_on_one_replica_and_hits_its_cache(llm) -> None:
    before = await llm.replica_stats()
    routed_before = list(llm.router.stats.routed)
    for question in ("What is rain?", "Why is the sky blue?", "What is a comet?", "How do bees fly?"):
        await llm.generate(SHARED + question, PARAMS)
    after = await llm.replica_stats()
    routed = [a - b for a, b in zip(llm.router.stats.routed, routed_before)]
    assert sorted(routed) == [0, 4], routed
    home = routed.index(4)
    hits = [a.prefix_hits - b.prefix_hits for a, b in zip(after, before)]
    shared_blocks = len(llm.tokenizer(SHARED).input_ids) // llm.info.block_size
    assert shared_blocks >= 3
    assert hits[home] >= 3 * shared_blocks * llm.info.block_size  # the three after the first
    assert hits[1 - home] == 0


async def test_aborts_reach_the_replica_each_request_runs_on(llm) -> None:
    endless = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    results: list = []

    async def one(prompt: str) -> None:
        results.append(await llm.generate(prompt, endless))

    async with anyio.create_task_group() as tg:
        for prompt in PROMPTS[:2]:
            tg.start_soon(one, prompt)
        # both running before the third arrives: the second went where the first was not
        with anyio.fail_after(60):
            while sum((s.num_running for s in await llm.replica_stats() if s), 0) < 2:
                await anyio.sleep(0.05)
        assert sorted(set(llm._routes.values())) == [0, 1]
        stream = llm.stream(PROMPTS[2], endless)
        async for _ in stream:  # a third request, then the caller walks away from it
            break
        await stream.aclose()
        assert sorted(await llm.abort_all()) == sorted(llm._routes)
    assert [r.finish_reason for r in results] == ["abort", "abort"]
    with anyio.fail_after(10):
        while await llm.tracked_requests() != {"frontend": 0, "scheduler": 0, "detokenizer": 0}:
            await anyio.sleep(0.05)
    assert (await llm.stats()).num_free_blocks == 2 * llm.info.num_blocks
    assert llm.router.in_flight == [0, 0]


async def test_a_killed_worker_costs_its_replica_a_restart_and_no_request_fails(llm, reference) -> None:
    nodes = replica_nodes(llm)
    victim = worker_of(nodes[0])
    restarts = [worker_of(n).restarts for n in nodes]
    results: list = [None] * 4

    async def one(i: int) -> None:
        results[i] = await llm.generate(PROMPTS[i], LONG)

    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(one, i)
        with anyio.fail_after(60):  # every request is running on its replica
            while sum((s.num_running for s in await llm.replica_stats() if s), 0) < 4:
                await anyio.sleep(0.05)
        assert llm.router.in_flight == [2, 2]
        os.kill(victim.pid, signal.SIGKILL)
    assert [r.text for r in results] == reference["long"]
    nodes = replica_nodes(llm)
    assert [worker_of(n).restarts for n in nodes] == [restarts[0] + 1, restarts[1]]
    assert worker_of(nodes[0]).pid != victim.pid
    assert await llm.tracked_requests() == {"frontend": 0, "scheduler": 0, "detokenizer": 0}


async def _four_running_then(llm, disrupt) -> dict[int, object]:
    """Run the first four prompts (two a replica), call `disrupt` once all four are running; each
    one's output, or the `EngineDeadError` it ended with."""
    results: dict[int, object] = {}

    async def one(i: int) -> None:
        try:
            results[i] = await llm.generate(PROMPTS[i], LONG)
        except sonar.EngineDeadError as exc:
            results[i] = exc

    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(one, i)
        with anyio.fail_after(60):
            while sum((s.num_running for s in await llm.replica_stats() if s), 0) < 4:
                await anyio.sleep(0.05)
        await disrupt()
    return results


async def test_a_replica_restarted_whole_moves_its_requests_and_serves_again(llm, reference) -> None:
    """Its scheduler's state is gone with it: its requests are replayed on replica 0
    (`sonar.engine.replay`) and end with the text they would have had."""
    old = llm.replicas.engine(1)
    moves = llm._moves
    results = await _four_running_then(llm, lambda: llm.supervisor.child("replica1").fail("stopped by the test"))
    assert [results[i].text for i in sorted(results)] == reference["long"][: len(results)]
    assert llm._moves == moves + 2
    with anyio.fail_after(120):  # the engine supervisor starts the replica again, a new supervisor
        while not llm.router.available[1]:
            await anyio.sleep(0.1)
    assert llm.replicas.engine(1) is not old
    outs = await llm.generate_many(PROMPTS, PARAMS)
    assert [o.text for o in outs] == reference["short"]
    assert llm.router.in_flight == [0, 0]


async def test_a_stopped_replicas_requests_end_with_503_when_no_other_serves(llm, reference) -> None:
    """Replica 0 counts as restarting (as while its worker is down), so replica 1's requests have
    nowhere to move when it stops: they end with `EngineDeadError` (503) naming why, replica 0's
    finish."""
    with anyio.fail_after(120):  # replica 1 is back from the test before
        while not llm.router.available[1]:
            await anyio.sleep(0.1)

    async def stop_second() -> None:
        llm.router.set_restarting(0, True)
        await llm.supervisor.child("replica1").fail("stopped by the test")

    try:
        results = await _four_running_then(llm, stop_second)
    finally:
        llm.router.set_restarting(0, False)
    failed = sorted(i for i, r in results.items() if isinstance(r, sonar.EngineDeadError))
    assert len(failed) == 2 and all("no other replica serves now" in str(results[i]) for i in failed)
    assert all(results[i].text == reference["long"][i] for i in results if i not in failed)
    assert sonar.EngineDeadError.status == 503
    with anyio.fail_after(120):
        while not llm.router.available[1]:
            await anyio.sleep(0.1)


async def test_a_crashed_scheduler_fails_only_its_replicas_requests(llm, reference) -> None:
    async def crash_second() -> None:
        on_second = [rid for rid, replica in llm._routes.items() if replica == 1]
        assert len(on_second) == 2
        # replica 1 was restarted whole by the test before: the listener follows its new supervisor
        await llm.replicas.engine(1).child("scheduler").fail("killed by the test")

    results = await _four_running_then(llm, crash_second)
    failed = [i for i, r in results.items() if isinstance(r, sonar.EngineDeadError)]
    assert len(failed) == 2 and all("replica 1" in str(results[i]) for i in failed)
    for i, r in results.items():
        if i not in failed:
            assert r.text == reference["long"][i]
    with anyio.fail_after(30):  # the replica's scheduler is back and the engine serves both again
        while llm.replicas.engine(1).child("scheduler").state != "running":
            await anyio.sleep(0.05)
    outs = await llm.generate_many(PROMPTS, PARAMS)
    assert [o.text for o in outs] == reference["short"]


@pytest.mark.parametrize(
    ("dp", "tp", "device_ids", "gpus", "want"),
    [
        (2, 1, None, 2, [(0, 1), (1, 1)]),  # a GPU each, the whole --gpu-memory-utilization of it
        (2, 2, None, 4, [(0, 1), (2, 1)]),  # replica 1's ranks on GPUs 2 and 3
        (2, 1, "1", 3, [(1, 1), (2, 1)]),  # from --device-ids on
        (2, 1, None, 1, [(0, 2), (0, 2)]),  # one GPU: shared, half of the share each
        (3, 1, None, 2, [(0, 3), (0, 3), (0, 3)]),  # too few for all: all share the first
        (2, 2, None, 3, [(0, 2), (0, 2)]),
        (1, 2, None, 4, [(0, 1)]),  # one engine: the ranks from the first GPU, as always
    ],
)
def test_each_replica_takes_its_own_gpus_where_the_machine_has_enough(
    dp: int, tp: int, device_ids: str | None, gpus: int, want: list[tuple[int, int]]
) -> None:
    config = EngineConfig.from_args("x", data_parallel_size=dp, tensor_parallel_size=tp, device_ids=device_ids)
    placed = [replica_gpus(replica_config(config, i) if dp > 1 else config, gpus, own_gpu=False) for i in range(dp)]
    assert placed == want


def test_replicas_share_the_memory_budget_and_run_their_workers_in_processes() -> None:
    config = EngineConfig.from_args(None, data_parallel_size=2, kv_cache_memory_bytes="1G", gpu_memory_utilization=0.8)
    second = replica_config(config, 1)
    assert second.data_parallel_index == 1 and second.data_parallel_size == 2
    assert second.kv_cache_memory_bytes == config.kv_cache_memory_bytes // 2
    assert second.gpu_memory_utilization == 0.8  # the worker divides it where replicas share a GPU
    assert second.placement["worker"] == "process"
    spec = data_parallel_spec(config)
    assert spec.name == "engine" and spec.strategy == "one_for_one"
    assert [c.name for c in spec.children] == ["replica0", "replica1"]
    for child in spec.children:
        assert isinstance(child, SupervisorSpec)
        worker = next(c for c in child.children if c.name == "worker")
        assert isinstance(worker.placement, ChildProcess)
    single = data_parallel_spec(EngineConfig.from_args(None))
    assert single.name == "engine" and [c.name for c in single.children] == ["worker", "detokenizer", "scheduler"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"data_parallel_size": 0}, "data_parallel_size must be at least 1"),
        ({"data_parallel_size": 2, "data_parallel_index": 2}, "data_parallel_index must be in 0..1"),
        ({"data_parallel_routing": "random"}, "data_parallel_routing must be one of prefix, load"),
        ({"data_parallel_size": 2, "placement": "worker=tcp://127.0.0.1:5555"}, "worker placed on another"),
        ({"data_parallel_size": 2, "kv_offloading_size": 1.0}, "KV offloading or KV events is not supported"),
    ],
)
def test_what_data_parallelism_cannot_do_is_refused(args: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_args(None, **args)


def test_replica_stats_add_up_position_by_position() -> None:
    from sonar.core.outputs import SchedulerStats
    from sonar.engine.llm import _sum_stats

    def stats(running: int, usage: float, per_position: list[int]) -> SchedulerStats:
        return SchedulerStats(running, 0, 0, usage, 10, 0, 0, spec_accepted_per_position=per_position)

    total = _sum_stats([stats(2, 0.5, [4, 2, 1]), stats(1, 0.25, []), stats(0, 0.0, [1])])
    assert (total.num_running, total.kv_usage, total.spec_accepted_per_position) == (3, 0.25, [5, 2, 1])
