"""KV cache residency bookkeeping: a fake clock, a real `BlockPool`, the three histograms."""

from __future__ import annotations

import random

import pytest

from sonar.core.block_pool import BlockPool
from sonar.core.free_queue import KVBlock
from sonar.core.kv_residency import RESIDENCY_BUCKETS, KVResidency, KVResidencyStats, ResidencyHistogram


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def pool_with(sample: float = 1.0, num_blocks: int = 4) -> tuple[BlockPool, KVResidency, Clock]:
    clock = Clock()
    pool = BlockPool(num_blocks)
    pool.residency = KVResidency(sample, clock=clock)
    return pool, pool.residency, clock


def test_a_cached_block_reused_then_evicted() -> None:
    pool, res, clock = pool_with(num_blocks=1)
    (block,) = pool.allocate(1)
    pool.cache(block, b"h" * 32)
    clock.now = 1.0
    pool.free([block])
    clock.now = 3.0
    pool.touch([block])  # a prefix-cache hit, 3 s after the allocation
    clock.now = 4.0
    pool.free([block])
    clock.now = 10.0
    pool.allocate(1)  # evicts it: lifetime 10 s, idle 6 s since released
    stats = res.stats
    assert (stats.reuse_gap.count, stats.reuse_gap.total) == (1, 3.0)
    assert (stats.lifetime.count, stats.lifetime.total) == (1, 10.0)
    assert (stats.idle_before_evict.count, stats.idle_before_evict.total) == (1, 6.0)
    assert res.num_followed == 1  # the new allocation is followed in turn
    pool.check_invariants()


def test_consecutive_hits_measure_from_the_previous_access() -> None:
    pool, res, clock = pool_with(num_blocks=1)
    (block,) = pool.allocate(1)
    for t in (2.0, 2.5, 7.5):
        clock.now = t
        pool.touch([block])
    assert res.stats.reuse_gap.count == 3
    assert res.stats.reuse_gap.total == pytest.approx(7.5)


def test_a_block_still_referenced_at_its_end_has_no_idle_time() -> None:
    # reset_prefix_cache then reallocation cannot happen while referenced; a block freed and
    # re-hit before eviction counts idle only from its last release
    pool, res, clock = pool_with(num_blocks=1)
    (block,) = pool.allocate(1)
    pool.cache(block, b"x" * 32)
    pool.free([block])
    clock.now = 5.0
    pool.touch([block])  # revived: no longer idle
    clock.now = 6.0
    pool.free([block])
    clock.now = 8.0
    pool.allocate(1)
    assert res.stats.idle_before_evict.total == pytest.approx(2.0)


def test_sampling_follows_about_the_fraction_asked() -> None:
    pool, res, _ = pool_with(sample=0.25, num_blocks=4000)
    pool.allocate(4000)
    assert 800 < res.num_followed < 1200


def test_unsampled_blocks_cost_no_observations() -> None:
    pool, res, clock = pool_with(sample=1e-9, num_blocks=2)
    blocks = pool.allocate(2)
    pool.touch(blocks)
    pool.free(blocks)
    pool.free(blocks)
    pool.allocate(2)
    assert res.num_followed == 0
    assert res.stats.lifetime.count == res.stats.reuse_gap.count == 0


def test_histogram_buckets_are_upper_bounds() -> None:
    h = ResidencyHistogram()
    for v in (0.0005, 0.001, 0.002, 1e9):
        h.observe(v)
    assert h.counts[0] == 2 and h.counts[1] == 1 and h.counts[len(RESIDENCY_BUCKETS)] == 1
    assert h.count == 4


def test_the_sample_rate_must_be_a_fraction() -> None:
    for bad in (0.0, 1.5, -1.0):
        with pytest.raises(ValueError, match="sample"):
            KVResidency(bad)


def test_random_traffic_observes_every_hit_and_every_end() -> None:
    """Random allocations, hits and frees on a small pool, every block followed: one reuse gap per
    hit, one lifetime per reallocation of a block allocated before, never a negative time, and
    the pool's own bookkeeping intact."""
    rng = random.Random(7)
    pool, res, clock = pool_with(num_blocks=8)
    held: list[KVBlock] = []
    hits = ends = 0
    ever: set[int] = set()
    for step in range(2000):
        clock.now += rng.random()
        action = rng.random()
        if action < 0.35 and pool.num_free:
            block = pool.allocate(1)[0]
            ends += block.block_id in ever
            ever.add(block.block_id)
            if rng.random() < 0.5:
                pool.cache(block, step.to_bytes(32, "big"))
            held.append(block)
        elif 0.35 <= action < 0.5 and held:
            block = rng.choice(held)
            pool.touch([block])
            held.append(block)
            hits += 1
        elif held:
            pool.free([held.pop(rng.randrange(len(held)))])
        pool.check_invariants()
    stats = res.stats
    assert stats.reuse_gap.count == hits > 100
    assert stats.lifetime.count == ends > 100
    assert stats.idle_before_evict.count <= ends
    assert min(stats.lifetime.total, stats.reuse_gap.total, stats.idle_before_evict.total) >= 0


def test_replicas_histograms_sum_bucket_by_bucket() -> None:
    a = KVResidencyStats(ResidencyHistogram(), ResidencyHistogram(), ResidencyHistogram())
    b = KVResidencyStats(ResidencyHistogram(), ResidencyHistogram(), ResidencyHistogram())
    a.lifetime.observe(0.005)
    b.lifetime.observe(0.005)
    b.lifetime.observe(20.0)
    b.reuse_gap.observe(2.0)
    total = KVResidencyStats.summed([a, b])
    assert total.lifetime.count == 3 and total.lifetime.total == pytest.approx(20.01)
    assert total.lifetime.counts[1] == 2 and total.reuse_gap.count == 1 and total.idle_before_evict.count == 0
