"""The processed-image cache (--mm-processor-cache-gb): least recently used entries leave first
within the byte budget, an entry over the whole budget is not kept, and a budget of 0 keeps
nothing."""

from __future__ import annotations

import torch

from sonar.multimodal.cache import ProcessedCache, processed_bytes


def test_least_recently_used_leave_first_within_the_budget() -> None:
    cache = ProcessedCache(100)
    for name in "abc":
        cache.put(name, name.upper(), 40)  # the third evicts the first
    assert cache.get("a") is None and cache.get("b") == "B" and cache.bytes == 80
    cache.put("d", "D", 40)  # "b" was used last: "c" goes
    assert cache.get("c") is None and cache.get("b") == "B" and cache.get("d") == "D"
    assert (cache.stats.hits, cache.stats.misses, cache.stats.evictions) == (3, 2, 2)
    cache.put("huge", "H", 101)
    assert cache.get("huge") is None and len(cache) == 2


def test_a_budget_of_zero_keeps_nothing() -> None:
    cache = ProcessedCache(0)
    cache.put(cache.key(b"png"), torch.zeros(3, 4, 4), 192)
    assert len(cache) == 0 and cache.get(cache.key(b"png")) is None


def test_processed_bytes_counts_pixels_or_patches() -> None:
    assert processed_bytes(torch.zeros(3, 4, 4)) == 192
    assert processed_bytes((torch.zeros(16, 12, dtype=torch.float64), [1, 4, 4])) == 16 * 12 * 8
