"""Processed images by the content of their encoded bytes (--mm-processor-cache-gb).

Decoding an image and running the image processor (resize, rescale, normalize, cut into patches)
costs tens to hundreds of milliseconds per picture, and the same picture is often sent again: each
turn of a chat re-sends the whole conversation. The cache maps the SHA-256 of an image's encoded
bytes to what the processor made of it (pixels, and the patch grid of a dynamic-resolution model),
keeping the most recently used within a byte budget. One engine's processor settings are fixed,
so the bytes alone key an entry.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0


class ProcessedCache:
    """The least recently used entries leave first when a new one would pass `max_bytes`; an entry
    larger than the whole budget is not kept."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.stats = CacheStats()
        self._entries: OrderedDict[str, tuple[Any, int]] = OrderedDict()

    @staticmethod
    def key(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()

    def get(self, key: str) -> Any | None:
        entry = self._entries.get(key)
        if entry is None:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(key)
        self.stats.hits += 1
        return entry[0]

    def put(self, key: str, value: Any, nbytes: int) -> None:
        if nbytes > self.max_bytes or key in self._entries:
            return
        while self.bytes + nbytes > self.max_bytes:
            _, (_, freed) = self._entries.popitem(last=False)
            self.bytes -= freed
            self.stats.evictions += 1
        self._entries[key] = (value, nbytes)
        self.bytes += nbytes

    def __len__(self) -> int:
        return len(self._entries)


def processed_bytes(value: Any) -> int:
    """Bytes a processor's output holds: a pixel tensor, or ``(patches, grid)``."""
    tensor = value[0] if isinstance(value, tuple) else value
    return int(tensor.numel() * tensor.element_size())
