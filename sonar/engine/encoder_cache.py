"""The worker's encoder output cache: an image's feature rows (what the vision tower and projector
give for it), kept by the image's hash so that the tower runs once per image.

A request keeps the rows of each image it is in the middle of (its chunks read them over several
steps), whatever this cache does; the cache keeps rows beyond that, for a later request that sends
the same image again and does not find all of its tokens in the prefix cache. It holds at most
`budget` rows (all images together, least recently used out first), as the reference's encoder
cache budget does: the step's token budget (``--max-num-batched-tokens``), raised to the rows of
the image being kept, so that one image of any size fits alone."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class EncoderCache:
    """Feature rows by image hash, least recently used out first, within `budget` rows."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.rows = 0
        """Rows held now."""
        self.entries: OrderedDict[str, Any] = OrderedDict()
        self.runs = 0
        """Images put here (each one run of the tower), since start."""
        self.hits = 0
        """Images whose rows came from here instead, since start."""

    def get(self, key: str, length: int) -> Any | None:
        """The `length` rows kept for `key` (now the most recently used), or None; rows of another
        count are not the image's (a library caller may set its own hash) and are not served."""
        rows = self.entries.get(key)
        if rows is not None and len(rows) != length:
            return None
        if rows is not None:
            self.entries.move_to_end(key)
            self.hits += 1
        return rows

    def put(self, key: str, rows: Any) -> None:
        """Keep `rows` (a tensor ``[n, ...]``) for `key`, dropping the least recently used entries
        until they fit; rows over the budget alone replace everything."""
        self.runs += 1
        if key in self.entries:
            self.rows -= len(self.entries.pop(key))
        n = len(rows)
        while self.entries and self.rows + n > self.budget:
            _, old = self.entries.popitem(last=False)
            self.rows -= len(old)
        self.entries[key] = rows
        self.rows += n

    def clear(self) -> None:
        """Drop every entry (the weights changed, so the rows are stale)."""
        self.entries.clear()
        self.rows = 0
