"""The offload manager as a real actor, in this process and in a child process."""

import os
import signal
import time

import anyio
import msgspec
import pytest
import torch

from sonar.actors import ActorError, ChildSpec, SupervisorSpec, supervise
from sonar.actors.messages import Ping
from sonar.core.events import BlockStored
from sonar.offload.config import KVEventsConfig
from sonar.offload.events import KVEventConsumer
from sonar.offload.manager import OffloadManagerActor
from sonar.protocol.offload import (
    Clear,
    Flush,
    GetOffloadStats,
    Load,
    LoadResult,
    Lookup,
    PublishEvents,
    Store,
    TierContents,
)
from tests.actors.helpers import wait_for
from tests.offload.helpers import config, layout, sequence

pytestmark = pytest.mark.anyio


def spec(placement, lay, cfg, events=None, **child):
    kwargs = {
        "config": msgspec.to_builtins(cfg),
        "layout": msgspec.to_builtins(lay),
        "events": None if events is None else msgspec.to_builtins(events),
    }
    child.setdefault("ping_interval", None)
    return SupervisorSpec(
        "root",
        [ChildSpec("offload", OffloadManagerActor, kwargs=kwargs, placement=placement, **child)],
        max_restarts=3,
        period=30,
    )


@pytest.mark.parametrize("bpc", [1, 2])
async def test_store_lookup_load_round_trip(placement, bpc):
    lay = layout(bpc)
    hashes, metas, data = sequence(lay, 3)
    async with supervise(spec(placement, lay, config(lay, cpu_chunks=8))) as sup:
        ref = sup.child("offload").ref
        await ref.send(Store(metas[:2], data[:2]))
        await ref.send(Store(metas[2:], data[2]))  # one chunk may come without the leading axis
        await ref.ask(Flush(), timeout=10)
        found = await ref.ask(Lookup(hashes), timeout=5)
        assert (found.num_blocks, found.mediums) == (3 * bpc, ["CPU"] * 3)
        result: LoadResult = await ref.ask(Load(hashes, start_block=bpc + 1 if bpc > 1 else 1), timeout=10)
        assert result.first_chunk == 1 and result.num_blocks == 3 * bpc and result.mediums == ["CPU", "CPU"]
        assert result.skip_blocks == (1 if bpc > 1 else 0)
        assert torch.equal(result.data, data[1:])
        missing = await ref.ask(Load(sequence(lay, 1, seed=9)[0]), timeout=10)
        assert missing.data is None and missing.num_blocks == 0
        stats = await ref.ask(GetOffloadStats(), timeout=5)
        cpu = stats.tier("CPU")
        assert cpu.chunks == 3 and cpu.stores == 3 and cpu.loads == 2 and cpu.used_bytes == 3 * lay.chunk_bytes
        assert stats.lookups == 1 and stats.hit_blocks == 3 * bpc and stats.load_latency["CPU"].count == 1
        view = await ref.ask(TierContents(), timeout=5)
        assert set(view["CPU"]) == set(hashes)
        assert await ref.ask(Clear(), timeout=5) == 3
        assert (await ref.ask(Lookup(hashes), timeout=5)).num_blocks == 0


async def test_a_bad_store_is_dropped_and_the_actor_lives(placement):
    lay = layout()
    hashes, metas, data = sequence(lay, 1)
    async with supervise(spec(placement, lay, config(lay, cpu_chunks=2))) as sup:
        ref = sup.child("offload").ref
        await ref.send(Store(metas, data.to(torch.float16)))
        await ref.ask(Flush(), timeout=10)
        assert (await ref.ask(Lookup(hashes), timeout=5)).num_blocks == 0
        assert sup.child("offload").restarts == 0


async def test_events_replayed_from_zero_match_the_managers_view(placement, tmp_path):
    """Stores, evictions, spills, promotions and a GPU event, then a replay from sequence 0 into the
    reference consumer: it holds exactly the blocks each tier holds."""
    lay = layout(2)
    events = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"ipc://{tmp_path}/pub",
        replay_endpoint=f"ipc://{tmp_path}/replay",
        topic="kv",
    )
    cfg = config(lay, cpu_chunks=3, disk=str(tmp_path / "disk"), disk_chunks=5)
    seqs = [sequence(lay, 3, seed=s) for s in range(3)]
    async with supervise(spec(placement, lay, cfg, events)) as sup:
        ref = sup.child("offload").ref
        for hashes, metas, data in seqs:
            await ref.send(Store(metas, data))
        await ref.ask(Flush(), timeout=10)
        await ref.ask(Load(seqs[0][0]), timeout=10)  # disk hits, promoted back to the CPU tier
        gpu = BlockStored([b"g" * 32], None, [1, 2, 3, 4], 4, medium="GPU")
        await ref.send(PublishEvents([gpu]))
        await ref.ask(Flush(), timeout=10)
        view = await ref.ask(TierContents(), timeout=5)
        stats = await ref.ask(GetOffloadStats(), timeout=5)
        assert stats.tier("CPU").evictions > 0 and stats.tier("DISK").evictions > 0

        def replay():
            with KVEventConsumer(events.endpoint, events.replay_endpoint, topic="kv") as consumer:
                deadline = time.monotonic() + 10
                while True:  # the publisher thread may still be sending the last batches
                    consumer.replay(0)
                    if all(set(view[m]) == consumer.index.blocks(m) for m in ("CPU", "DISK")):
                        return consumer
                    if time.monotonic() > deadline:
                        return consumer
                    time.sleep(0.05)

        consumer = await anyio.to_thread.run_sync(replay)
        assert consumer.index.blocks("CPU") == set(view["CPU"])
        assert consumer.index.blocks("DISK") == set(view["DISK"])
        assert consumer.index.blocks("GPU") == {b"g" * 32}
        assert len(view["CPU"]) == 6 and len(view["DISK"]) == 10


async def test_the_disk_tier_survives_a_restart(placement, tmp_path):
    lay = layout()
    hashes, metas, data = sequence(lay, 4)
    cfg = config(lay, cpu_chunks=8, disk=str(tmp_path), disk_chunks=8)
    async with supervise(spec(placement, lay, cfg)) as sup:
        ref = sup.child("offload").ref
        await ref.send(Store(metas, data))
        await ref.ask(Flush(), timeout=10)
    async with supervise(spec(placement, lay, cfg)) as sup:  # a new server over the same directory
        ref = sup.child("offload").ref
        found = await ref.ask(Lookup(hashes), timeout=5)
        assert (found.num_blocks, found.mediums) == (4, ["DISK"] * 4)
        result = await ref.ask(Load(hashes), timeout=10)
        assert torch.equal(result.data, data) and result.mediums == ["DISK"] * 4
        stats = await ref.ask(GetOffloadStats(), timeout=5)
        assert stats.tier("DISK").loads == 4 and stats.load_latency["DISK"].count == 1


async def test_a_killed_manager_restarts_empty_in_cpu_and_reindexes_disk(tmp_path):
    """SIGKILL the manager's process: its supervisor restarts it; the CPU tier is empty, the disk
    tier is back, and asks keep being answered."""
    from sonar.actors import ChildProcess

    lay = layout()
    cpu_only, cpu_metas, cpu_data = sequence(lay, 2, seed=1)
    on_disk, disk_metas, disk_data = sequence(lay, 2, seed=2)
    cfg = config(lay, cpu_chunks=8, disk=str(tmp_path), disk_chunks=8)
    async with supervise(spec(ChildProcess(), lay, cfg)) as sup:
        runner = sup.child("offload")
        await runner.ref.send(Store(disk_metas, disk_data))
        await runner.ref.ask(Flush(), timeout=10)
        pong = await runner.ref.ask(Ping(), timeout=5)
        os.kill(pong.pid, signal.SIGKILL)
        await wait_for(lambda: runner.restarts == 1 and runner.state == "running", timeout=30)
        ref = sup.child("offload").ref
        found = await ref.ask(Lookup(on_disk), timeout=10)
        assert found.mediums == ["DISK", "DISK"]
        view = await ref.ask(TierContents(), timeout=5)
        assert view["CPU"] == [] and set(view["DISK"]) == set(on_disk)
        await ref.send(Store(cpu_metas, cpu_data))
        await ref.ask(Flush(), timeout=10)
        assert (await ref.ask(Lookup(cpu_only), timeout=5)).mediums == ["CPU", "CPU"]


async def test_lookups_are_answered_while_a_slow_load_runs(tmp_path):
    """A load of many large chunks from disk runs in a thread; lookups sent after it are answered
    before it finishes (they never wait behind tier I/O)."""
    from sonar.actors import InProcess

    lay = layout(num_layers=16, num_kv_heads=8, head_dim=64, block_size=16)  # 256 KiB chunks
    hashes, metas, data = sequence(lay, 64)
    cfg = config(lay, cpu_chunks=1, disk=str(tmp_path), disk_chunks=100)
    async with supervise(spec(InProcess(), lay, cfg)) as sup:
        ref = sup.child("offload").ref
        await ref.send(Store(metas, data))
        await ref.ask(Flush(), timeout=60)
        order = []

        async def load():
            result = await ref.ask(Load(hashes), timeout=60)
            order.append(("load", len(result.mediums)))

        async with anyio.create_task_group() as tg:
            tg.start_soon(load)
            await anyio.sleep(0)  # the load is in the mailbox first
            for _ in range(3):
                found = await ref.ask(Lookup(hashes[:1]), timeout=5)
                order.append(("lookup", found.num_blocks))
        assert order[:3] == [("lookup", 1)] * 3 and order[3] == ("load", 64)


async def test_load_errors_come_back_as_errors(placement):
    lay = layout(2)
    async with supervise(spec(placement, lay, config(lay, cpu_chunks=2))) as sup:
        ref = sup.child("offload").ref
        with pytest.raises(ActorError):
            await ref.ask(Load([b"x" * 32, b"y" * 32], start_block=-4), timeout=5)
        assert (await ref.ask(Lookup([]), timeout=5)).num_blocks == 0


@pytest.mark.parametrize("bpc", [1, 2, 4])
async def test_gather_store_load_scatter_restores_the_primary_blocks(placement, bpc):
    """The worker's side end to end: gather a prefix's blocks from real per-layer caches, store
    them, load them back and scatter them into other blocks of another cache: identical KV."""
    from sonar.core.prefix import PrefixHasher
    from sonar.kernels.attention import allocate_kv_caches
    from sonar.offload.layout import KVLayout
    from sonar.offload.transfer import gather_chunks, scatter_chunks
    from sonar.protocol.offload import ChunkMeta

    torch.manual_seed(bpc)
    src = allocate_kv_caches(2, 16, 4, 2, 8, torch.float32)
    for c in src:
        c.normal_()
    lay = KVLayout.for_caches(src, model="tiny", blocks_per_chunk=bpc)
    tokens = list(range(100, 100 + 4 * 4))  # four full blocks
    hashes = PrefixHasher(4).chain(tokens)
    src_blocks = [9, 3, 12, 5]
    data = gather_chunks(src, src_blocks, bpc)
    metas = [
        ChunkMeta(
            hashes[c * bpc : (c + 1) * bpc], hashes[c * bpc - 1] if c else None, tokens[c * bpc * 4 : (c + 1) * bpc * 4]
        )
        for c in range(4 // bpc)
    ]
    async with supervise(spec(placement, lay, config(lay, cpu_chunks=8))) as sup:
        ref = sup.child("offload").ref
        await ref.send(Store(metas, data))
        await ref.ask(Flush(), timeout=10)
        # block 0 is still in the primary cache of the new request: load blocks 1..3
        result = await ref.ask(Load(hashes, start_block=1), timeout=10)
    dst = allocate_kv_caches(2, 16, 4, 2, 8, torch.float32)
    dst_blocks = [0, 7, 1]
    scatter_chunks(dst, result.data, dst_blocks[: result.num_blocks - 1], skip_blocks=result.skip_blocks)
    for layer in range(2):
        for s, d in zip(src_blocks[1:], dst_blocks):
            assert torch.equal(dst[layer][:, d], src[layer][:, s])


async def test_events_only_mode_publishes_and_misses(placement, tmp_path):
    """Without tiers (only --kv-events-config) the manager publishes the GPU events it is sent."""
    events = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"ipc://{tmp_path}/pub",
        replay_endpoint=f"ipc://{tmp_path}/replay",
    )
    kwargs = {"config": None, "layout": None, "events": msgspec.to_builtins(events)}
    tree = SupervisorSpec(
        "root", [ChildSpec("offload", OffloadManagerActor, kwargs=kwargs, placement=placement, ping_interval=None)]
    )
    async with supervise(tree) as sup:
        ref = sup.child("offload").ref
        await ref.send(PublishEvents([BlockStored([b"a" * 32, b"b" * 32], None, list(range(8)), 4, medium="GPU")]))
        assert (await ref.ask(Lookup([b"a" * 32]), timeout=5)).num_blocks == 0
        assert (await ref.ask(GetOffloadStats(), timeout=5)).tiers == []

        def replay():
            with KVEventConsumer(events.endpoint, events.replay_endpoint) as consumer:
                deadline = time.monotonic() + 10
                while consumer.index.blocks("GPU") != {b"a" * 32, b"b" * 32} and time.monotonic() < deadline:
                    consumer.replay(0)
                    time.sleep(0.05)
                return consumer.index.blocks("GPU")

        assert await anyio.to_thread.run_sync(replay) == {b"a" * 32, b"b" * 32}


async def test_tier_watchers_get_events_then_a_snapshot_after_a_restart(placement, tmp_path):
    """`WatchTiers`: a watcher without the manager's epoch gets a snapshot; a watcher up to date
    waits and is answered with the next tier events (or with none when its wait is over); after a
    restart (new epoch) the old position is answered with a snapshot of what the new run holds,
    and `Load(count_hits=True)` counts the chunks it serves as hits."""
    from sonar.core.events import BlockRemoved
    from sonar.protocol.offload import TierUpdate, WatchTiers

    lay = layout()
    hashes, metas, data = sequence(lay, 3)
    cfg = config(lay, cpu_chunks=2, disk=str(tmp_path), disk_chunks=8)
    async with supervise(spec(placement, lay, cfg)) as sup:
        runner = sup.child("offload")
        first: TierUpdate = await runner.ref.ask(WatchTiers(None, 0, 0.0), timeout=10)
        assert first.snapshot == {"CPU": [], "DISK": []} and first.events == []
        idle: TierUpdate = await runner.ref.ask(WatchTiers(first.epoch, first.seq, 0.2), timeout=10)
        assert idle.events == [] and idle.seq == first.seq and idle.snapshot is None

        async def watch() -> TierUpdate:
            return await runner.ref.ask(WatchTiers(first.epoch, first.seq, 10.0), timeout=20)

        async with anyio.create_task_group() as tg:
            got: list[TierUpdate] = []
            tg.start_soon(lambda: _collect(watch, got))
            await anyio.sleep(0.2)  # parked: nothing new yet
            assert got == []
            await runner.ref.send(Store(metas, data))  # 3 chunks into a 2-chunk CPU tier: one evicted
        (update,) = got
        assert update.snapshot is None and update.seq > first.seq
        stored = [e for e in update.events if isinstance(e, BlockStored)]
        assert {e.medium for e in stored} <= {"CPU", "DISK"} and any(e.medium == "CPU" for e in stored)
        await runner.ref.ask(Flush(), timeout=10)
        rest: TierUpdate = await runner.ref.ask(WatchTiers(first.epoch, update.seq, 0.5), timeout=10)
        events = update.events + rest.events
        assert any(isinstance(e, BlockRemoved) and e.medium == "CPU" for e in events)
        loaded = await runner.ref.ask(Load(hashes, count_hits=True), timeout=10)
        assert loaded.num_blocks == 3
        stats = await runner.ref.ask(GetOffloadStats(), timeout=5)
        assert stats.tier("CPU").hit_blocks + stats.tier("DISK").hit_blocks == 3

        await runner.fail("killed by the test")
        await wait_for(lambda: runner.restarts == 1 and runner.state == "running", timeout=30)
        after: TierUpdate = await sup.child("offload").ref.ask(WatchTiers(first.epoch, rest.seq, 0.0), timeout=10)
    assert after.epoch != first.epoch and after.snapshot is not None
    assert after.snapshot["CPU"] == [] and set(after.snapshot["DISK"]) == set(hashes)


async def _collect(fn, out: list) -> None:
    out.append(await fn())
