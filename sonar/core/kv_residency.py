"""KV cache residency (``--kv-cache-metrics``): how long sampled blocks keep their content, how
long they sit unreferenced before it is dropped, and how far apart their reuses are.

The block pool calls `allocated`, `hit` and `released` as blocks change hands; a fraction
``sample`` of allocations is followed (a seeded draw, so tests and reruns see the same blocks).
A followed block's residency starts when it is allocated and ends when the pool hands it out
again (evicting its cached content, or reusing a free block that had none); then

- its **lifetime** is the time from allocation to that end,
- its **idle time before eviction** the time from its last reference dropped to that end,
- and each prefix-cache **hit** on it in between observes a **reuse gap**: the time since its
  previous access (its allocation or its previous hit).

The observations go into fixed-bucket histograms (`ResidencyHistogram`) that `SchedulerStats`
carries to ``/metrics`` as vLLM's ``kv_block_lifetime_seconds``,
``kv_block_idle_before_evict_seconds`` and ``kv_block_reuse_gap_seconds``. Following a block
costs a dictionary entry; the others cost one branch.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

__all__ = ["RESIDENCY_BUCKETS", "KVResidency", "KVResidencyStats", "ResidencyHistogram"]

#: Upper bounds (seconds) of the histograms' buckets; the last bucket is +Inf.
RESIDENCY_BUCKETS = (0.001, 0.01, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0, 3600.0)


class ResidencyHistogram(msgspec.Struct, gc=False):
    """Observation counts per bucket of `RESIDENCY_BUCKETS` (not cumulative; one more for +Inf),
    and the sum of the observations."""

    counts: list[int] = msgspec.field(default_factory=lambda: [0] * (len(RESIDENCY_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        i = 0
        while i < len(RESIDENCY_BUCKETS) and seconds > RESIDENCY_BUCKETS[i]:
            i += 1
        self.counts[i] += 1
        self.total += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)


class KVResidencyStats(msgspec.Struct, gc=False):
    """The three histograms since start (`SchedulerStats.kv_residency`)."""

    lifetime: ResidencyHistogram
    idle_before_evict: ResidencyHistogram
    reuse_gap: ResidencyHistogram

    @staticmethod
    def summed(parts: list[KVResidencyStats]) -> KVResidencyStats:
        """Several replicas' histograms as one (bucket by bucket)."""

        def total(field: str) -> ResidencyHistogram:
            hists = [getattr(p, field) for p in parts]
            return ResidencyHistogram([sum(c) for c in zip(*(h.counts for h in hists))], sum(h.total for h in hists))

        return KVResidencyStats(total("lifetime"), total("idle_before_evict"), total("reuse_gap"))


@dataclass
class _Followed:
    allocated: float
    accessed: float
    released: float | None = None


class KVResidency:
    """The sampled blocks' times and the histograms of what ended."""

    def __init__(self, sample: float, *, seed: int = 0, clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < sample <= 1:
            raise ValueError(f"sample must be in (0, 1], got {sample}")
        self.sample = sample
        self.clock = clock
        self._rng = random.Random(seed)
        self._followed: dict[int, _Followed] = {}
        self.stats = KVResidencyStats(ResidencyHistogram(), ResidencyHistogram(), ResidencyHistogram())

    def allocated(self, block_id: int) -> None:
        """The pool handed `block_id` out: a followed block's residency ends; maybe a new one starts."""
        now = self.clock()
        ended = self._followed.pop(block_id, None)
        if ended is not None:
            self.stats.lifetime.observe(now - ended.allocated)
            if ended.released is not None:
                self.stats.idle_before_evict.observe(now - ended.released)
        if self.sample >= 1 or self._rng.random() < self.sample:
            self._followed[block_id] = _Followed(now, now)

    def hit(self, block_id: int) -> None:
        """A request found `block_id` in the prefix cache."""
        followed = self._followed.get(block_id)
        if followed is None:
            return
        now = self.clock()
        self.stats.reuse_gap.observe(now - followed.accessed)
        followed.accessed = now
        followed.released = None

    def released(self, block_id: int) -> None:
        """`block_id`'s last reference was dropped (it went to the free queue)."""
        followed = self._followed.get(block_id)
        if followed is not None:
            followed.released = self.clock()

    @property
    def num_followed(self) -> int:
        return len(self._followed)
