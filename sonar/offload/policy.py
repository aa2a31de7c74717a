"""Eviction order of a tier: LRU, or ARC (adaptive replacement cache).

A policy only orders keys; the tier decides when to evict (it is over its size) and asks
``pop_victim()`` for the key to drop. Not thread-safe: the tier calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

__all__ = ["ARCPolicy", "EvictionPolicy", "LRUPolicy", "make_policy"]


class EvictionPolicy(Protocol):
    def insert(self, key: bytes) -> None:
        """A key became resident."""

    def touch(self, key: bytes) -> None:
        """A resident key was used (a hit)."""

    def remove(self, key: bytes) -> None:
        """A resident key is gone for a reason of its own (corrupt, cleared); no-op if unknown."""

    def pop_victim(self) -> bytes:
        """Choose the resident key to evict next and forget it; ``IndexError`` when empty."""

    def __len__(self) -> int: ...


class LRUPolicy:
    """Least recently used (inserted or touched) first."""

    def __init__(self, capacity: int = 0) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, key: bytes) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def pop_victim(self) -> bytes:
        if not self._order:
            raise IndexError("no resident key to evict")
        return self._order.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._order)


class ARCPolicy:
    """Adaptive replacement (Megiddo & Modha): balances recency (T1) against frequency (T2).

    Keys seen once live in T1, keys hit again in T2. Evicted keys are remembered (ghosts B1, B2,
    bounded by ``capacity``); a new key that is a ghost of B1 means T1 was too small, so the target
    size ``p`` of T1 grows, a ghost of B2 shrinks it. ``capacity`` is the tier's size in chunks.
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"ARC needs a positive capacity, got {capacity}")
        self.capacity = capacity
        self.p = 0.0
        self.t1: OrderedDict[bytes, None] = OrderedDict()
        self.t2: OrderedDict[bytes, None] = OrderedDict()
        self.b1: OrderedDict[bytes, None] = OrderedDict()
        self.b2: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, key: bytes) -> None:
        if key in self.t1 or key in self.t2:
            self.touch(key)
            return
        c = self.capacity
        if key in self.b1:
            self.p = min(float(c), self.p + max(len(self.b2) / len(self.b1), 1.0))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None
        while len(self.t1) + len(self.b1) > c and self.b1:
            self.b1.popitem(last=False)
        while len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * c and self.b2:
            self.b2.popitem(last=False)

    def touch(self, key: bytes) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def remove(self, key: bytes) -> None:
        self.t1.pop(key, None)
        self.t2.pop(key, None)

    def pop_victim(self) -> bytes:
        if self.t1 and (len(self.t1) > self.p or not self.t2):
            key = self.t1.popitem(last=False)[0]
            self.b1[key] = None
        elif self.t2:
            key = self.t2.popitem(last=False)[0]
            self.b2[key] = None
        else:
            raise IndexError("no resident key to evict")
        return key

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    if name == "lru":
        return LRUPolicy(capacity)
    if name == "arc":
        return ARCPolicy(max(capacity, 1))
    raise ValueError(f"unknown eviction policy {name!r}; choose lru or arc")
