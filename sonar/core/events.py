"""KV cache events as data: what a tier stored, removed or cleared (no I/O here).

These structs are the wire format of ``sonar.offload.events`` (msgpack, one array per event, its first
element the event's name). The block manager produces the ``GPU`` ones, the offload manager the
``CPU`` and ``DISK`` ones; the publisher numbers and sends them in batches.

``BlockStored`` is self-describing: it carries the parent hash, every token id, the block size
and the extra keys, so a consumer can index (or re-derive) the hashes without asking the engine.
A consumer keeps, per medium, a reference count per hash: +1 for each ``BlockStored`` that lists
it, -1 for each ``BlockRemoved``, and ignores removals of hashes it does not know.
"""

from __future__ import annotations

from typing import Literal, Union

import msgspec

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KVEvent", "KVEventBatch", "MEDIUMS", "Medium"]

Medium = Literal["GPU", "CPU", "DISK"]
MEDIUMS: tuple[str, ...] = ("GPU", "CPU", "DISK")


class BlockStored(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """Blocks became available in ``medium``: ``block_hashes[i]`` covers
    ``token_ids[i * block_size : (i + 1) * block_size]``; the first one's parent is
    ``parent_block_hash`` (None: the first block of a sequence)."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str = "GPU"
    extra_keys: list[list[object] | None] | None = None
    """Per block, the extra keys its hash covers (the cache salt of a first block), or None."""


class BlockRemoved(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """Blocks left ``medium`` (evicted, dropped as corrupt, ...)."""

    block_hashes: list[bytes]
    medium: str = "GPU"


class AllBlocksCleared(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """Every block of ``medium`` is gone (None: of every medium)."""

    medium: str | None = None


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(msgspec.Struct, array_like=True, frozen=True):
    """One published message: when it was made and its events, in order."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None
