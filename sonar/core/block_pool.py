"""The pool of KV blocks: reference counts, the prefix-cache map and the free queue.

A block is in exactly one of two states: referenced (``ref_cnt > 0``, in one or more block
tables) or free (``ref_cnt == 0``, in the free queue). Independently, a block may be the
prefix cache's entry for a hash (``block_hash`` set). A free cached block stays findable
until the free queue hands it out again, which evicts it from the cache.

Freed blocks without cached content go to the head of the free queue, so they are reused
before any cached block is evicted; freed cached blocks go to the tail, so eviction is
least-recently-freed first.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from sonar.core.events import AllBlocksCleared, BlockRemoved, KVEvent
from sonar.core.free_queue import FreeBlockQueue, KVBlock
from sonar.core.kv_residency import KVResidency
from sonar.core.prefix import BlockHash

__all__ = ["BlockPool"]


class BlockPool:
    """Owns every ``KVBlock``; hands them out, takes them back and indexes cached ones."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        """Prefix cache: block hash -> the one block holding that content."""
        self.num_evictions = 0
        self.event_log: list[KVEvent] | None = None
        """When a list (KV events on), every cache entry that goes away is appended to it as a
        ``BlockRemoved`` (medium ``GPU``), a reset as ``AllBlocksCleared``."""
        self.residency: KVResidency | None = None
        """--kv-cache-metrics: told of every allocation, prefix-cache hit and release."""

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now, cached-but-free ones included."""
        return self.free_queue.num_free

    def usage(self) -> float:
        """Fraction of blocks referenced by some request (0.0 to 1.0)."""
        return 1.0 - self.free_queue.num_free / self.num_blocks

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash)

    def allocate(self, count: int) -> list[KVBlock]:
        """Take ``count`` blocks from the free queue (evicting cached content) with ref 1."""
        if count > self.free_queue.num_free:
            raise ValueError(f"cannot allocate {count} blocks: only {self.free_queue.num_free} free")
        out = []
        popleft = self.free_queue.popleft
        log = self.event_log
        for _ in range(count):
            block = popleft()
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                if log is not None:
                    log.append(BlockRemoved([block.block_hash], "GPU"))
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        if self.residency is not None:
            for block in out:
                self.residency.allocated(block.block_id)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add one reference to each block (prefix-cache hits), reviving free ones."""
        remove = self.free_queue.remove
        residency = self.residency
        for block in blocks:
            if block.ref_cnt == 0:
                remove(block)
            block.ref_cnt += 1
            if residency is not None:
                residency.hit(block.block_id)

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Drop one reference from each block, in the given order (first freed, first evicted)."""
        queue = self.free_queue
        residency = self.residency
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if residency is not None:
                    residency.released(block.block_id)
                if block.block_hash is None:
                    queue.appendleft(block)
                else:
                    queue.append(block)
            elif block.ref_cnt < 0:
                raise AssertionError(f"{block!r} freed more often than it was referenced")

    def cache(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Make ``block`` the cache entry for ``block_hash`` unless another block already is.

        Two requests can compute the same content in parallel; only the first block
        registered becomes findable, the duplicate stays a plain block.
        """
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def uncache(self, block: KVBlock) -> None:
        """Forget ``block``'s cached content (it was never computed, or the cache is reset)."""
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            if self.event_log is not None:
                self.event_log.append(BlockRemoved([block.block_hash], "GPU"))
            block.block_hash = None

    def reset_cache(self) -> int:
        """Forget all cached content; return how many entries were dropped."""
        dropped = len(self.cached)
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        if self.event_log is not None:
            self.event_log.append(AllBlocksCleared("GPU"))
        return dropped

    def check_invariants(self, expected_refs: Counter[int] | None = None) -> None:
        """Raise ``AssertionError`` unless the pool's bookkeeping is consistent.

        ``expected_refs`` maps block id -> how many block tables hold it; when given, every
        block's ``ref_cnt`` must equal it (blocks absent from it must be free).
        """
        free = self.free_queue.check()
        free_ids = {b.block_id for b in free}
        if len(free_ids) != len(free):
            raise AssertionError("a block appears twice in the free queue")
        for block in self.blocks:
            in_queue = block.block_id in free_ids
            if block.ref_cnt < 0:
                raise AssertionError(f"{block!r} has a negative reference count")
            if (block.ref_cnt == 0) != in_queue:
                state = "is" if in_queue else "is not"
                raise AssertionError(f"{block!r} {state} in the free queue")
            if block.block_hash is not None and self.cached.get(block.block_hash) is not block:
                raise AssertionError(f"{block!r} carries a hash the cache does not map to it")
            if expected_refs is not None and block.ref_cnt != expected_refs.get(block.block_id, 0):
                raise AssertionError(f"{block!r}: {expected_refs.get(block.block_id, 0)} block tables hold it")
        for block_hash, block in self.cached.items():
            if block.block_hash != block_hash:
                raise AssertionError(f"cache entry {block_hash[:4].hex()} points at {block!r}")
