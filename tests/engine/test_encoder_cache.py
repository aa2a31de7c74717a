"""The worker's encoder output cache (`sonar.engine.encoder_cache`): rows by image hash within a
budget of rows, least recently used out first; an image over the budget is kept alone."""

from __future__ import annotations

import torch

from sonar.engine.encoder_cache import EncoderCache


def rows(n: int) -> torch.Tensor:
    return torch.zeros(n, 4)


def test_least_recently_used_rows_leave_first_within_the_budget() -> None:
    cache = EncoderCache(budget=10)
    cache.put("a", rows(4))
    cache.put("b", rows(4))
    assert cache.get("a", 4) is not None  # a is now the most recently used
    cache.put("c", rows(4))  # 12 rows: b leaves
    assert cache.get("b", 4) is None and cache.get("a", 4) is not None and cache.get("c", 4) is not None
    assert cache.rows == 8 and (cache.runs, cache.hits) == (3, 3)


def test_an_image_over_the_budget_is_kept_alone() -> None:
    cache = EncoderCache(budget=8)
    cache.put("a", rows(4))
    cache.put("big", rows(20))
    assert list(cache.entries) == ["big"] and cache.rows == 20
    cache.put("a", rows(4))  # the big one leaves for any other
    assert list(cache.entries) == ["a"] and cache.rows == 4


def test_the_same_image_again_replaces_its_rows_and_clear_empties() -> None:
    cache = EncoderCache(budget=8)
    cache.put("a", rows(4))
    cache.put("a", rows(4))
    assert cache.rows == 4 and len(cache.entries) == 1
    assert cache.get("a", 5) is None and cache.hits == 0  # another row count is another image
    cache.clear()
    assert cache.rows == 0 and cache.get("a", 4) is None
