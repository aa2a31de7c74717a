"""KV offloading end to end in the engine (`sonar.open`): real tiny models, real actors, no mocks.

* A prefix evicted from a deliberately tiny primary cache comes back from the CPU tier: the
  output equals that of an engine without offloading, the request reports the loaded tokens as
  cached, and the scheduler and the manager count the hits; chunk sizes 1, 2 and 4 blocks agree.
* The disk tier (TieringOffloadingSpec) survives a restart of the engine; a corrupted chunk file
  is detected, dropped and never served (the rest of the prefix is recomputed, same output).
* The KV event stream, replayed from sequence 0 into the reference consumer, yields exactly the
  blocks each tier holds at the end (the manager's own view for CPU and DISK, the block
  manager's prefix cache for GPU).
* A crash of the offload manager is survived: its supervisor restarts it (CPU tier empty, disk
  re-indexed), the scheduler's mirror resynchronizes, and requests keep flowing with the same
  outputs.
* Preemptions under offloading keep every output; events alone (no tiers) publish the primary
  cache's events; the manager and the worker in child processes behave the same.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import sonar
from sonar.offload.events import KVEventConsumer
from sonar.protocol.engine import CacheState, DescribeCache
from sonar.protocol.offload import Flush, GetOffloadStats, OffloadStats, TierContents, WatchTiers
from sonar.sampling_params import SamplingParams
from tests.engine.conftest import TinyCheckpoint
from tests.http.conftest import free_port

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("one_thread")]

BLOCK = 16
#: 12 primary blocks (192 tokens): two prompts of 9 blocks cannot both stay cached.
GPU_BLOCKS = 12
PROMPT_TOKENS = 150
#: Blocks of a 150-token prompt that may be served from a cache (the last token is always computed).
REUSABLE_BLOCKS = (PROMPT_TOKENS - 1) // BLOCK
NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def _prompts(n: int, vocab: int = 384) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(1, vocab, (PROMPT_TOKENS,), generator=g).tolist() for _ in range(n)]


def _engine_args(**extra: Any) -> dict[str, Any]:
    return dict(
        dtype="float32",
        max_model_len=192,
        num_gpu_blocks_override=GPU_BLOCKS,
        block_size=BLOCK,
        max_num_seqs=4,
        **extra,
    )


def _transfer(bpc: int = 1, disk: Path | None = None) -> dict[str, Any]:
    extra: dict[str, Any] = {"blocks_per_chunk": bpc, "cpu_size_gib": 0.01}
    if disk is not None:
        extra.update(spec_name="TieringOffloadingSpec", disk_path=str(disk), disk_size_gib=0.01)
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


async def _offload(llm: Any, msg: Any) -> Any:
    return await llm.supervisor.child("offload").ref.ask(msg, timeout=30)


async def _scheduler_cache(llm: Any) -> CacheState:
    return await llm.supervisor.child("scheduler").ref.ask(DescribeCache(), timeout=30)


async def _settle(llm: Any) -> None:
    """Wait until the stores of finished requests have reached the tiers (and the mirror)."""
    for _ in range(3):
        await anyio.sleep(0.1)
        await _offload(llm, Flush())
    await anyio.sleep(0.3)  # the scheduler's tier watch applies the events


async def _evict_and_reuse(llm: Any, prompts: list[list[int]]) -> tuple[list[Any], Any]:
    """Run prompt 0, then prompts 1 and 2 (which evict it from the primary cache), then prompt 0
    again; returns the four outputs."""
    outs = []
    for p in (prompts[0], prompts[1], prompts[2]):
        outs.append(await llm.generate(p, GREEDY))
        await _settle(llm)
    outs.append(await llm.generate(prompts[0], GREEDY))
    return outs, await llm.stats()


@pytest.fixture(scope="module")
def reference(tiny_engine_checkpoints: dict[str, TinyCheckpoint]) -> dict[str, Any]:
    """The same requests on an engine without offloading."""
    ckpt = tiny_engine_checkpoints["llama3"]
    prompts = _prompts(3)

    async def run() -> list[list[int]]:
        async with sonar.open(str(ckpt.path), **_engine_args()) as llm:
            outs = [await llm.generate(p, GREEDY) for p in (prompts[0], prompts[1], prompts[2], prompts[0])]
            return [o.token_ids for o in outs]

    return {"path": str(ckpt.path), "prompts": prompts, "tokens": anyio.run(run, backend="asyncio")}


@pytest.mark.parametrize(("bpc", "decode_steps"), [(1, 1), (2, 1), (4, 1), (1, 4)])
async def test_evicted_prefix_comes_back_from_the_cpu_tier(
    reference: dict[str, Any], bpc: int, decode_steps: int
) -> None:
    """``decode_steps`` 4: multi-step decode, whose requests end with more positions than tokens kept."""
    engine = _engine_args(kv_transfer_config=_transfer(bpc), decode_steps=decode_steps)
    async with sonar.open(reference["path"], **engine) as llm:
        outs, stats = await _evict_and_reuse(llm, reference["prompts"])
        offload: OffloadStats = await _offload(llm, GetOffloadStats())
    assert [o.token_ids for o in outs] == reference["tokens"]
    loaded = REUSABLE_BLOCKS // bpc * bpc  # whole chunks only
    assert outs[0].num_cached_tokens == 0
    assert outs[3].num_cached_tokens == loaded * BLOCK
    assert stats.offload_hits == loaded * BLOCK
    cpu = offload.tier("CPU")
    assert cpu.hit_blocks == loaded and cpu.loads == loaded // bpc and cpu.stores >= 3 * (REUSABLE_BLOCKS // bpc)
    assert offload.load_latency["CPU"].count == 1


async def test_disk_tier_survives_a_restart_and_drops_a_corrupt_chunk(
    reference: dict[str, Any], tmp_path: Path
) -> None:
    disk = tmp_path / "kv"
    args = _engine_args(kv_transfer_config=_transfer(1, disk))
    prompt, expected = reference["prompts"][0], reference["tokens"][0]
    async with sonar.open(reference["path"], **args) as llm:
        first = await llm.generate(prompt, GREEDY)
        await _settle(llm)
    assert first.token_ids == expected
    files = sorted(disk.glob("*.kvchunk"))
    assert len(files) == REUSABLE_BLOCKS  # the 9 full blocks (the 10th is partial)

    # A restarted engine over the same directory serves the prefix from disk.
    async with sonar.open(reference["path"], **args) as llm:
        again = await llm.generate(prompt, GREEDY)
        stats: OffloadStats = await _offload(llm, GetOffloadStats())
    assert again.token_ids == expected
    assert again.num_cached_tokens == REUSABLE_BLOCKS * BLOCK
    assert stats.tier("DISK").hit_blocks == REUSABLE_BLOCKS and stats.tier("DISK").corrupt == 0

    # Corrupt the chunk of block 4 (flip payload bytes): blocks 0-3 load, the rest is recomputed.
    from sonar.core.prefix import PrefixHasher

    hashes = PrefixHasher(BLOCK).chain(prompt)
    victim = disk / f"{hashes[4].hex()}.kvchunk"
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    raw[len(raw) // 2 + 1] ^= 0xFF
    victim.write_bytes(bytes(raw))
    async with sonar.open(reference["path"], **args) as llm:
        third = await llm.generate(prompt, GREEDY)
        stats = await _offload(llm, GetOffloadStats())
    assert third.token_ids == expected
    assert third.num_cached_tokens == 4 * BLOCK
    assert stats.tier("DISK").corrupt == 1
    assert stats.tier("DISK").hit_blocks == 4  # blocks served: the load stopped at the corrupt chunk
    assert not victim.exists() or victim.read_bytes() != bytes(raw)  # dropped (then stored again, intact)


async def test_event_replay_matches_every_tier(reference: dict[str, Any], tmp_path: Path) -> None:
    pub, replay = free_port(), free_port()
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{pub}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay}",
        "topic": "kv",
    }
    args = _engine_args(kv_transfer_config=_transfer(2, tmp_path / "kv"), kv_events_config=events)
    async with sonar.open(reference["path"], **args) as llm:
        outs, _ = await _evict_and_reuse(llm, reference["prompts"])
        await _settle(llm)
        contents: dict[str, list[bytes]] = await _offload(llm, TierContents())
        gpu = set((await _scheduler_cache(llm)).block_hashes)

        def consume() -> Any:
            with KVEventConsumer(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", topic="kv") as consumer:
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:  # the last batches may still be on their way
                    consumer.replay(0)
                    if consumer.index.blocks("CPU") == set(contents["CPU"]) and consumer.index.blocks("GPU") == gpu:
                        break
                    time.sleep(0.1)
                return consumer

        consumer = await anyio.to_thread.run_sync(consume)
    assert [o.token_ids for o in outs] == reference["tokens"]
    index = consumer.index
    assert index.blocks("CPU") == set(contents["CPU"]) and contents["CPU"]
    assert index.blocks("DISK") == set(contents["DISK"]) and contents["DISK"]
    assert index.blocks("GPU") == gpu and gpu


async def test_offload_manager_crash_is_survived(reference: dict[str, Any], tmp_path: Path) -> None:
    prompts, expected = reference["prompts"], reference["tokens"]
    args = _engine_args(kv_transfer_config=_transfer(1, tmp_path / "kv"))
    async with sonar.open(reference["path"], **args) as llm:
        await llm.generate(prompts[0], GREEDY)
        await _settle(llm)
        manager = llm.supervisor.child("offload")
        await manager.fail("killed by the test")
        with anyio.fail_after(30):
            while manager.state != "running" or manager.restarts < 1:
                await anyio.sleep(0.05)
        # Requests keep flowing while and after it restarts; the disk tier was re-indexed.
        outs = [await llm.generate(p, GREEDY) for p in (prompts[1], prompts[2])]
        await _settle(llm)
        again = await llm.generate(prompts[0], GREEDY)
        stats: OffloadStats = await _offload(llm, GetOffloadStats())
        # the scheduler's mirror follows the new run of the manager
        epoch = (await _offload(llm, WatchTiers(None, 0, 0.0))).epoch
        assert (await _scheduler_cache(llm)).tier_epoch == epoch
    assert [o.token_ids for o in outs] == expected[1:3]
    assert again.token_ids == expected[3]
    assert again.num_cached_tokens == REUSABLE_BLOCKS * BLOCK
    assert stats.tier("CPU").hit_blocks + stats.tier("DISK").hit_blocks == REUSABLE_BLOCKS


@pytest.mark.parametrize("decode_steps", [1, 4])
async def test_preemptions_with_offloading_keep_outputs(reference: dict[str, Any], decode_steps: int) -> None:
    """Four requests that outgrow the 12-block cache together: some are preempted (their chunks
    offered to the CPU tier) and resumed (loading back what the tier holds by then); every output
    equals the one computed alone without offloading (with multi-step decode too, whose KV slots
    ahead take more of the cache)."""
    prompts = [p[:40] for p in _prompts(4)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    async with sonar.open(reference["path"], **_engine_args()) as llm:
        expected = [(await llm.generate(p, params)).token_ids for p in prompts]
    engine = _engine_args(kv_transfer_config=_transfer(1), decode_steps=decode_steps)
    async with sonar.open(reference["path"], **engine) as llm:
        outs = await llm.generate_many(prompts, params)
        stats = await llm.stats()
    assert [o.token_ids for o in outs] == expected
    assert stats.num_preemptions > 0
    assert stats.num_running == stats.num_waiting == stats.num_loading == 0
    assert stats.num_free_blocks == GPU_BLOCKS


async def test_events_without_offloading(reference: dict[str, Any]) -> None:
    """`--kv-events-config` alone: the manager only publishes the primary cache's events."""
    pub = free_port()
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{pub}"}
    async with sonar.open(reference["path"], **_engine_args(kv_events_config=events)) as llm:
        consumer = KVEventConsumer(f"tcp://127.0.0.1:{pub}")
        try:
            await anyio.sleep(0.3)  # let the subscription reach the publisher (no replay endpoint)
            out = await llm.generate(reference["prompts"][0], GREEDY)
            seen: list[Any] = []
            with anyio.fail_after(10):
                while not any(e.medium == "GPU" for _, e in seen if hasattr(e, "block_hashes")):
                    seen += await anyio.to_thread.run_sync(consumer.poll, 0.2)
        finally:
            consumer.close()
    assert out.token_ids == reference["tokens"][0]
    stored = [e for _, e in seen if type(e).__name__ == "BlockStored"]
    assert stored and all(e.medium == "GPU" for e in stored)
    assert {"CPU", "DISK"}.isdisjoint(e.medium for _, e in seen if hasattr(e, "medium"))


async def test_manager_and_worker_in_their_own_processes(reference: dict[str, Any], tmp_path: Path) -> None:
    """The same scenario with the offload manager and the worker each in a child process: chunks
    travel between them as zero-copy frames."""
    args = _engine_args(
        kv_transfer_config=_transfer(2, tmp_path / "kv"), placement={"offload": "process", "worker": "process"}
    )
    async with sonar.open(reference["path"], **args) as llm:
        outs, _ = await _evict_and_reuse(llm, reference["prompts"])
    assert [o.token_ids for o in outs] == reference["tokens"]
    assert outs[3].num_cached_tokens == REUSABLE_BLOCKS // 2 * 2 * BLOCK


async def test_cache_salt_separates_every_tier_and_the_events(reference: dict[str, Any], tmp_path: Path) -> None:
    """A prefix stored under one salt is found again, after its eviction from the primary cache,
    in the CPU and disk tiers under that salt only; chunk files and published hashes are the salted
    chain's, never the unsalted one's."""
    from sonar.core.prefix import PrefixHasher

    pub, replay = free_port(), free_port()
    events = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://127.0.0.1:{pub}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay}",
    }
    disk = tmp_path / "kv"
    args = _engine_args(kv_transfer_config=_transfer(1, disk), kv_events_config=events)
    prompts = reference["prompts"]
    async with sonar.open(reference["path"], **args) as llm:
        first = await llm.generate(prompts[0], GREEDY, cache_salt="tenant-a")
        for p in prompts[1:3]:  # evict it from the primary cache (it stays in the tiers)
            await _settle(llm)
            await llm.generate(p, GREEDY)
        await _settle(llm)
        other = await llm.generate(prompts[0], GREEDY, cache_salt="tenant-b")
        await _settle(llm)
        for p in prompts[1:3]:
            await llm.generate(p, GREEDY)
            await _settle(llm)
        same = await llm.generate(prompts[0], GREEDY, cache_salt="tenant-a")
        await _settle(llm)

        def consume() -> list[Any]:
            with KVEventConsumer(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}") as consumer:
                return [event for _, event in consumer.replay(0)]

        published = await anyio.to_thread.run_sync(consume)
    assert first.token_ids == other.token_ids == same.token_ids == reference["tokens"][0]
    assert first.num_cached_tokens == 0
    assert other.num_cached_tokens == 0  # nothing of tenant-a's, in any tier
    assert same.num_cached_tokens == REUSABLE_BLOCKS * BLOCK  # loaded back from the tiers

    hasher = PrefixHasher(BLOCK)
    salted_a = hasher.chain(prompts[0], cache_salt="tenant-a")
    salted_b = hasher.chain(prompts[0], cache_salt="tenant-b")
    plain = hasher.chain(prompts[0])
    files = {p.name for p in disk.glob("*.kvchunk")}
    assert {h.hex() + ".kvchunk" for h in salted_a[:REUSABLE_BLOCKS]} <= files
    assert {h.hex() + ".kvchunk" for h in salted_b[:REUSABLE_BLOCKS]} <= files
    assert not {h.hex() + ".kvchunk" for h in plain} & files
    stored = {(e.medium, h) for e in published if type(e).__name__ == "BlockStored" for h in e.block_hashes}
    for medium in ("GPU", "CPU", "DISK"):
        assert {(medium, h) for h in salted_a[:REUSABLE_BLOCKS]} <= stored, medium
    assert not {h for _, h in stored} & set(plain)
    salted_first = [e for e in published if type(e).__name__ == "BlockStored" and e.block_hashes[0] == salted_a[0]]
    assert salted_first and all(e.parent_block_hash is None and e.extra_keys[0] == ["tenant-a"] for e in salted_first)
