"""The block manager's and scheduler's hooks for KV offloading and KV events (pure, no I/O).

``OffloadRunner`` extends the fingerprint runner of ``simulate.py`` with a second tier of
fingerprints: it gathers ``kv_stores`` before the step writes anything, loads ``kv_loads`` a few
steps later, and reports back. Since the fake runner checks every position a request attends to,
a chunk offloaded from the wrong blocks, or loaded into the wrong ones, fails at once.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import pytest

from sonar.core.blocks import BlockManager
from sonar.core.kv_index import KVBlockIndex
from sonar.core.outputs import KVLoadSpec, SchedulerOutput
from sonar.core.request import Request, RequestStatus
from sonar.core.schedule import Scheduler, SchedulerConfig
from tests.core.simulate import FakeRunner

BS = 4


class Tier:
    """A bounded LRU tier of chunk fingerprints keyed by the chunk's last block hash."""

    def __init__(self, bpc: int, capacity: int) -> None:
        self.bpc = bpc
        self.capacity = capacity
        self.chunks: OrderedDict[bytes, list[int]] = OrderedDict()
        self.lookups = 0

    def lookup(self, request: Request) -> int:
        self.lookups += 1
        n = 0
        hashes = request.block_hashes
        while (n + 1) * self.bpc <= len(hashes) and hashes[(n + 1) * self.bpc - 1] in self.chunks:
            n += 1
        return n * self.bpc

    def put(self, key: bytes, values: list[int]) -> list[bytes]:
        self.chunks[key] = values
        self.chunks.move_to_end(key)
        evicted = []
        while len(self.chunks) > self.capacity:
            evicted.append(self.chunks.popitem(last=False)[0])
        return evicted


class OffloadRunner(FakeRunner):
    def __init__(self, scheduler: Scheduler, tier: Tier, rng: random.Random | None = None) -> None:
        super().__init__(scheduler)
        self.tier = tier
        self.rng = rng
        self.pending: list[tuple[int, KVLoadSpec]] = []
        self.events = KVBlockIndex()
        self.stored = 0
        self.loaded_blocks = 0

    def execute(
        self,
        out: SchedulerOutput,
        sample: Callable[[str], int] = lambda request_id: 7,
        model: Callable[[list[int]], int] | None = None,
    ) -> dict[str, list[int]]:
        bm = self.scheduler.block_manager
        bs, bpc = self.block_size, self.tier.bpc
        for spec in out.kv_stores:  # before the step writes: the blocks may be reused by it
            assert len(spec.block_ids) == len(spec.block_hashes) == bpc
            assert len(spec.token_ids) == bpc * bs
            values = [self.kv.get((b, o)) for b in spec.block_ids for o in range(bs)]
            assert None not in values, "offered a block that was never computed"
            bm.forget_offloaded(self.tier.put(spec.block_hashes[-1], values))
            self.stored += 1
        sampled = super().execute(out, sample, model)
        delay = 0 if self.rng is None else self.rng.choice([0, 0, 1, 3])
        self.pending += [(delay, spec) for spec in out.kv_loads]
        return sampled

    def finish_loads(self, *, everything: bool = False) -> None:
        still = []
        for delay, spec in self.pending:
            if delay > 0 and not everything:
                still.append((delay - 1, spec))
                continue
            self.scheduler.finish_kv_load(spec.req_id, self.load(spec), spec.load_id)
        self.pending = still

    def load(self, spec: KVLoadSpec) -> int:
        """Copy what the tier still holds into the request's blocks; return the blocks loaded."""
        bs, bpc = self.block_size, self.tier.bpc
        loaded = 0
        for i, block_id in enumerate(spec.block_ids):
            b = spec.start_block + i
            chunk = self.tier.chunks.get(spec.block_hashes[(b // bpc + 1) * bpc - 1])
            if chunk is None:
                break
            for o in range(bs):
                self.kv[(block_id, o)] = chunk[(b % bpc) * bs + o]
            loaded += 1
        self.loaded_blocks += loaded
        return loaded

    def step(self, *args: Any, **kwargs: Any):
        result = super().step(*args, **kwargs)
        self.finish_loads()
        self.scheduler.check_invariants()
        self.check_events()
        return result

    def check_events(self) -> None:
        bm = self.scheduler.block_manager
        self.events.apply_all(bm.take_kv_events())
        assert self.events.blocks("GPU") == set(bm.pool.cached)

    def drain(self, max_steps: int = 10_000) -> int:
        for steps in range(max_steps):
            scheduler = self.scheduler
            if not (scheduler.has_unfinished_requests() or scheduler.has_pending_kv_transfers() or self.pending):
                return steps
            self.step()
        raise AssertionError("requests still unfinished")


def make(num_blocks: int = 32, bpc: int = 1, tier_chunks: int = 64, rng=None, **config: Any):
    config.setdefault("max_model_len", min(64, num_blocks * BS - BS))
    config.setdefault("max_num_batched_tokens", 64)
    config.setdefault("max_num_seqs", 8)
    bm = BlockManager(num_blocks, BS, kv_events=True, offload_blocks_per_chunk=bpc)
    tier = Tier(bpc, tier_chunks)
    scheduler = Scheduler(SchedulerConfig(**config), bm, lower_tier_lookup=tier.lookup)
    return scheduler, OffloadRunner(scheduler, tier, rng)


def test_kv_events_announce_cache_entries_with_their_content():
    bm = BlockManager(4, BS, kv_events=True)
    r = Request("a", list(range(10)), cache_salt="s")
    bm.update_hashes(r)
    assert bm.allocate_slots(r, 10)
    (stored,) = bm.take_kv_events()
    assert stored.block_hashes == r.block_hashes[:2] and stored.parent_block_hash is None
    assert stored.token_ids == list(range(8)) and stored.block_size == BS and stored.medium == "GPU"
    assert stored.extra_keys == [["s"], None]
    bm.free("a")
    other = Request("b", list(range(100, 116)))
    bm.update_hashes(other)
    assert bm.allocate_slots(other, 16)  # needs every block: evicts a's two cached blocks
    events = bm.take_kv_events()
    removed = [h for e in events if type(e).__name__ == "BlockRemoved" for h in e.block_hashes]
    assert sorted(removed) == sorted(r.block_hashes[:2])
    bm.reset_prefix_cache()
    assert type(bm.take_kv_events()[-1]).__name__ == "AllBlocksCleared"
    assert BlockManager(4, BS).take_kv_events() == []


def test_a_finished_request_offers_its_computed_chunks_once():
    scheduler, runner = make(bpc=2)
    runner.add(Request("a", list(range(13)), max_tokens=1))
    out, _ = runner.step()
    assert out.kv_stores == []
    out, _ = runner.step()  # the stores reach the runner with the next step
    (spec,) = out.kv_stores
    r_hashes = scheduler.block_manager.hasher.chain(list(range(13)))
    assert spec.block_hashes == r_hashes[:2] and spec.parent_hash is None and spec.token_ids == list(range(8))
    # the same prompt again: its chunk is in the tier already, not offered twice
    runner.add(Request("b", list(range(13)), max_tokens=1))
    runner.drain()
    assert runner.stored == 1
    scheduler.block_manager.forget_offloaded([r_hashes[1]])  # the tier dropped it
    runner.add(Request("c", list(range(13)), max_tokens=1))
    runner.drain()
    assert runner.stored == 2


def finish_step(runner: OffloadRunner, out: SchedulerOutput) -> None:
    """The rest of ``FakeRunner.step`` for a step scheduled by the test itself."""
    runner.check_output(out)
    runner.execute(out)
    updates = runner.scheduler.update_from_output({r.req_id: [7] for r in out.requests if r.sample})
    for update in updates:
        runner.tokens[update.req_id].extend(update.new_token_ids)
        if update.finish_reason is not None:
            runner.forget(update.req_id)


def evict_everything(scheduler: Scheduler, runner: OffloadRunner, prompt: list[int]) -> None:
    """Fill the primary cache with unrelated prompts so ``prompt``'s cached blocks are evicted."""
    bm = scheduler.block_manager
    for i in range(3):
        runner.add(Request(f"filler{i}", list(range(1000 + 40 * i, 1040 + 40 * i)), max_tokens=1))
        runner.drain()
    runner.check_events()
    hashes = bm.hasher.chain(prompt)
    assert not set(bm.pool.cached) & set(hashes)
    assert hashes[-1] in runner.tier.chunks or len(hashes) % runner.tier.bpc


@pytest.mark.parametrize("bpc", [1, 2, 4])
def test_an_evicted_prefix_is_loaded_from_the_tier_not_recomputed(bpc):
    scheduler, runner = make(num_blocks=12, bpc=bpc)
    prompt = list(range(33))  # 8 full blocks, then one token
    runner.add(Request("first", prompt, max_tokens=2))
    runner.drain()
    evict_everything(scheduler, runner, prompt)
    runner.add(Request("again", prompt, max_tokens=2))
    runner.add(Request("other", list(range(500, 505)), max_tokens=3))
    out = scheduler.schedule()
    scheduler.check_invariants()
    # "again" waits for its load and spends no budget; "other" runs meanwhile
    assert [r.req_id for r in out.requests] == ["other"]
    (load,) = out.kv_loads
    assert load.req_id == "again" and load.start_block == 0 and len(load.block_ids) == 8
    assert scheduler.get_request("again").status == RequestStatus.WAITING_FOR_KV
    assert scheduler.stats().num_loading == 1
    finish_step(runner, out)
    runner.finish_loads(everything=True)
    out, _ = runner.step()
    (again,) = [r for r in out.requests if r.req_id == "again"]
    assert again.start_pos == 32 and again.token_ids == [32] and again.is_new
    runner.drain()
    stats = scheduler.stats()
    assert stats.offload_hits == 32 and runner.loaded_blocks == 8


def test_a_partial_load_recomputes_the_rest():
    scheduler, runner = make(num_blocks=12, bpc=1)
    prompt = list(range(21))
    runner.add(Request("first", prompt, max_tokens=1))
    runner.drain()
    evict_everything(scheduler, runner, prompt)
    runner.add(Request("again", prompt, max_tokens=1))
    out = scheduler.schedule()
    (load,) = out.kv_loads
    finish_step(runner, out)
    # the tier lost blocks 2.. meanwhile: only two blocks arrive
    for h in load.block_hashes[2:]:
        runner.tier.chunks.pop(h)
    runner.finish_loads(everything=True)
    out, updates = runner.step()
    (again,) = out.requests
    assert again.start_pos == 8 and len(again.token_ids) == 13 and again.is_new
    assert updates[0].num_cached_tokens == 8


def test_a_primary_hit_is_extended_from_the_tier():
    scheduler, runner = make(num_blocks=16, bpc=1)
    prompt = list(range(25))
    runner.add(Request("first", prompt, max_tokens=1))
    runner.drain()
    bm = scheduler.block_manager
    r = Request("probe", prompt)
    bm.update_hashes(r)
    # evict the tail of the prefix from the primary cache only
    for h in r.block_hashes[2:]:
        bm.pool.uncache(bm.pool.cached[h])
    runner.add(Request("again", prompt, max_tokens=1))
    out = scheduler.schedule()
    (load,) = out.kv_loads
    assert load.start_block == 2 and len(load.block_ids) == 4 and len(load.block_hashes) == 6
    finish_step(runner, out)
    runner.finish_loads(everything=True)
    runner.drain()
    assert scheduler.stats().offload_hits == 16


def test_abort_while_loading_keeps_the_blocks_until_the_load_ends():
    scheduler, runner = make(num_blocks=12)
    prompt = list(range(17))
    runner.add(Request("first", prompt, max_tokens=1))
    runner.drain()
    evict_everything(scheduler, runner, prompt)
    runner.add(Request("again", prompt, max_tokens=1))
    out = scheduler.schedule()
    assert out.kv_loads
    free_before = scheduler.block_manager.num_free_blocks
    assert scheduler.abort(["again"]) == ["again"]
    runner.forget("again")
    scheduler.check_invariants()
    assert scheduler.block_manager.num_free_blocks == free_before  # still held for the runner
    assert scheduler.finish_kv_load("again", 4)
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks
    assert not scheduler.finish_kv_load("again", 4)  # a late duplicate is ignored
    scheduler.check_invariants()


def test_a_worker_failure_requeues_loading_requests():
    scheduler, runner = make(num_blocks=12)
    prompt = list(range(17))
    runner.add(Request("first", prompt, max_tokens=1))
    runner.drain()
    evict_everything(scheduler, runner, prompt)
    runner.add(Request("again", prompt, max_tokens=2))
    out = scheduler.schedule()
    assert out.kv_loads
    (stale,) = out.kv_loads
    scheduler.reset_after_worker_failure()
    runner.crash()
    runner.pending.clear()
    scheduler.check_invariants()
    assert scheduler.get_request("again").status == RequestStatus.PREEMPTED
    out = scheduler.schedule()
    (again,) = out.kv_loads  # admitted to load again (the tier still holds the prefix) ...
    assert again.load_id != stale.load_id
    assert not scheduler.finish_kv_load("again", 4, stale.load_id)  # ... the dead worker's report is ignored
    assert scheduler.get_request("again").status == RequestStatus.WAITING_FOR_KV
    finish_step(runner, out)
    runner.finish_loads(everything=True)
    runner.drain()  # reloaded from the tier or recomputed: either way the fingerprints check out


def test_lookup_off_and_prompt_logprobs_skip_the_tier():
    scheduler, runner = make(num_blocks=12)
    prompt = list(range(17))
    runner.add(Request("first", prompt, max_tokens=1))
    runner.drain()
    evict_everything(scheduler, runner, prompt)
    runner.add(Request("logprobs", prompt, max_tokens=1, skip_reading_prefix_cache=True))
    out, _ = runner.step()
    assert not out.kv_loads and out.requests[0].start_pos == 0


def test_offloading_needs_prefix_caching():
    with pytest.raises(ValueError, match="needs prefix caching"):
        BlockManager(4, BS, enable_prefix_caching=False, offload_blocks_per_chunk=1)


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_with_a_tier(seed):
    """Shared prefixes, a tiny primary cache, a small tier, delayed and partial loads, aborts and
    worker crashes; every read is checked and the GPU events always mirror the prefix cache."""
    rng = random.Random(seed)
    bpc = rng.choice([1, 2, 4])
    scheduler, runner = make(
        num_blocks=rng.randint(13, 20),
        bpc=bpc,
        tier_chunks=rng.randint(16, 60),
        rng=rng,
        max_model_len=48,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    prefixes = [[rng.randrange(4, 60) for _ in range(rng.randint(8, 30))] for _ in range(4)]
    ids = iter(range(10**6))
    for _ in range(400):
        if rng.random() < 0.35:
            prompt = list(rng.choice(prefixes)) if rng.random() < 0.8 else []
            prompt += [rng.randrange(4, 60) for _ in range(rng.randint(1, 12))]
            runner.add(
                Request(
                    f"r{next(ids)}",
                    prompt[:47],
                    max_tokens=rng.choice([1, 2, 5]),
                    cache_salt=rng.choice([None, None, "t"]),
                )
            )
        if scheduler.requests and rng.random() < 0.04:
            victim = rng.choice(list(scheduler.requests))
            scheduler.abort([victim])
            runner.forget(victim)
        if rng.random() < 0.01:
            scheduler.reset_after_worker_failure()
            runner.crash()
            runner.pending.clear()
        if rng.random() < 0.05 and runner.tier.chunks:  # the tier loses a chunk on its own
            key = rng.choice(list(runner.tier.chunks))
            del runner.tier.chunks[key]
            scheduler.block_manager.forget_offloaded([key])
        runner.step(sample=lambda _: rng.randrange(4, 60))
    runner.drain()
    bm = scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert runner.stored > 0 and runner.loaded_blocks > 0, (bpc, runner.tier.capacity, runner.tier.lookups)


def test_stores_dropped_by_a_worker_failure_are_offered_again():
    """Chunks offered but never stored (the worker died first) must not stay marked as offloaded."""
    scheduler, runner = make(num_blocks=12)
    prompt = list(range(17))
    runner.add(Request("first", prompt, max_tokens=1))
    while scheduler.has_unfinished_requests():
        runner.step()
    bm = scheduler.block_manager
    assert bm.has_kv_stores and bm.offloaded_keys  # offered when "first" finished, not stored yet
    scheduler.reset_after_worker_failure()
    assert not bm.has_kv_stores and not bm.offloaded_keys
    runner.crash()
    runner.add(Request("again", prompt, max_tokens=1))
    runner.drain()
    assert bm.offloaded_keys == set(runner.tier.chunks)  # offered again, and stored this time
