"""The offload manager's messages and its statistics (one tagged union: ``OffloadMsg``).

Chunk tensors travel inside the messages as torch tensors: in-process as the very object, across
processes as zero-copy frames of Sonar's codec (``sonar.actors.codec``).
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from sonar.actors import Ask
from sonar.core.events import KVEvent

__all__ = [
    "ChunkMeta",
    "Clear",
    "Flush",
    "GetOffloadStats",
    "LatencyHistogram",
    "Load",
    "LoadResult",
    "Lookup",
    "LookupResult",
    "OffloadMsg",
    "OffloadStats",
    "PublishEvents",
    "Store",
    "TierContents",
    "TierStats",
    "TierUpdate",
    "WatchTiers",
]

LOAD_LATENCY_BOUNDS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]
"""Upper bounds (seconds) of the load latency histogram's buckets (a last, unbounded one follows)."""


class ChunkMeta(msgspec.Struct, frozen=True):
    """What a chunk holds besides its tensor (enough to announce it as a ``BlockStored``)."""

    block_hashes: list[bytes]
    parent_hash: bytes | None
    token_ids: list[int]
    extra_keys: list[list[object] | None] | None = None

    @property
    def key(self) -> bytes:
        return self.block_hashes[-1]


class TierStats(msgspec.Struct):
    medium: str
    """``CPU`` or ``DISK``."""
    capacity_bytes: int
    used_bytes: int
    chunks: int
    stores: int = 0
    """Chunks written into this tier (stores, write-through, spills, promotions)."""
    store_bytes: int = 0
    loads: int = 0
    """Chunks served from this tier."""
    load_bytes: int = 0
    hit_blocks: int = 0
    """Blocks that lookups found in this tier (the fastest tier holding them)."""
    evictions: int = 0
    corrupt: int = 0
    """Chunks found damaged (dropped, never served)."""
    foreign: int = 0
    """Chunk files of another model, dtype, layout or format (ignored)."""
    write_errors: int = 0
    """Chunk writes that failed (disk full, I/O error); the chunk stayed in the faster tier only."""
    degraded: bool = False
    """The tier takes no writes for now, after a write failed (it retries after a while)."""


class LatencyHistogram(msgspec.Struct):
    bounds: list[float]
    counts: list[int]
    """``counts[i]``: observations <= ``bounds[i]`` and above the previous bound; one more at the end."""
    sum: float = 0.0
    count: int = 0

    @classmethod
    def empty(cls) -> "LatencyHistogram":
        return cls(list(LOAD_LATENCY_BOUNDS), [0] * (len(LOAD_LATENCY_BOUNDS) + 1))

    def observe(self, seconds: float) -> None:
        i = 0
        while i < len(self.bounds) and seconds > self.bounds[i]:
            i += 1
        self.counts[i] += 1
        self.sum += seconds
        self.count += 1


class OffloadStats(msgspec.Struct):
    tiers: list[TierStats]
    lookups: int = 0
    lookup_blocks: int = 0
    """Blocks asked about by lookups; ``hit_blocks / lookup_blocks`` per tier is its hit rate."""
    hit_blocks: int = 0
    duplicate_stores: int = 0
    """Chunks offered that the tiers already held (not copied again)."""
    load_latency: dict[str, LatencyHistogram] = {}
    """Per medium (the slowest tier a load read from), seconds from request to reply."""
    pending_io: int = 0
    events_dropped: int = 0
    """KV event batches the publisher dropped, its queue full (``--kv-events-config`` max_queue_size)."""

    def tier(self, medium: str) -> TierStats:
        return next(t for t in self.tiers if t.medium == medium)


class Store(msgspec.Struct, tag="offload.store"):
    """Keep these chunks: ``data[i]`` (``[num_chunks, *KVLayout.chunk_shape]``) holds ``chunks[i]``.

    Fire and forget; chunks the tiers already hold are only touched.
    """

    chunks: list[ChunkMeta]
    data: Any


class LookupResult(msgspec.Struct):
    num_blocks: int
    """Leading blocks (from the sequence's first) available in the lower tiers."""
    mediums: list[str]
    """Per available chunk, the fastest tier holding it."""


class Lookup(Ask, tag="offload.lookup"):
    """How many leading blocks of a sequence (its block hashes, from block 0) the tiers hold."""

    block_hashes: list[bytes]
    reply_type = LookupResult


class LoadResult(msgspec.Struct):
    first_chunk: int
    """Index (in the sequence) of the first chunk in ``data``."""
    data: Any
    """``[num_chunks, *chunk_shape]`` tensor, or None when nothing was found."""
    mediums: list[str]
    num_blocks: int
    """Leading blocks of the sequence now covered: ``(first_chunk + num_chunks) * blocks_per_chunk``
    (at most ``len(block_hashes)``); smaller than asked when a chunk went missing since the lookup."""
    skip_blocks: int = 0
    """Blocks at the start of ``data`` before ``start_block`` (the caller does not need them)."""


class Load(Ask, tag="offload.load"):
    """The chunks covering blocks ``start_block .. len(block_hashes) - 1`` of a sequence.

    ``block_hashes`` are the sequence's hashes from block 0 (only whole chunks are loaded).
    """

    block_hashes: list[bytes]
    start_block: int = 0
    count_hits: bool = False
    """Count the chunks served as lookup hits of their tier (the engine looks up in its own mirror
    of the tiers, so the manager sees its hits only here)."""
    reply_type = LoadResult


class GetOffloadStats(Ask, tag="offload.stats"):
    reply_type = OffloadStats


class Flush(Ask, tag="offload.flush"):
    """Reply once every store and load received before it has finished its I/O."""

    reply_type = int


class TierContents(Ask, tag="offload.contents"):
    """The block hashes each tier holds now (the manager's own view; for checks and debugging)."""

    reply_type = dict[str, list[bytes]]


class Clear(Ask, tag="offload.clear"):
    """Drop the CPU tier (and the disk tier with ``disk=True``); reply how many chunks went."""

    disk: bool = False
    reply_type = int


class PublishEvents(msgspec.Struct, tag="offload.events"):
    """KV events of another tier (the scheduler's ``GPU`` ones) to publish with the manager's own."""

    events: list[KVEvent]


class TierUpdate(msgspec.Struct):
    """What changed in the tiers since a watcher's sequence number (see ``WatchTiers``)."""

    epoch: str
    """Names this run of the manager (a restarted manager has another one)."""
    seq: int
    """The sequence number after ``events``: the ``since`` of the next ``WatchTiers``."""
    events: list[KVEvent]
    """The tiers' own events (``CPU`` / ``DISK`` media), in order."""
    snapshot: dict[str, list[bytes]] | None = None
    """When set, the watcher's view is stale (another epoch, or too far behind): replace it with
    these block hashes per medium (``events`` is then empty)."""


class WatchTiers(Ask, tag="offload.watch"):
    """A long poll for the tiers' events after ``since`` in ``epoch``: answered at once when there
    are some (or a snapshot, when ``epoch`` is not the manager's), else when the next ones come or
    after ``wait`` seconds (with none). The scheduler keeps its lookup mirror with it."""

    epoch: str | None = None
    since: int = 0
    wait: float = 5.0
    reply_type = TierUpdate


OffloadMsg = Union[Store, Lookup, Load, GetOffloadStats, Flush, TierContents, Clear, PublishEvents, WatchTiers]
