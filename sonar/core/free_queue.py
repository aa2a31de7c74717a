"""KV blocks and the O(1) queue of free blocks.

The free queue is an intrusive doubly linked list threaded through the blocks themselves,
so a block can be taken out of the middle in O(1) when a prefix-cache hit revives it. The
head is the next block to hand out (and, if it still holds cached content, to evict); the
tail holds the most recently freed cached blocks. Appending at the tail and popping at the
head makes eviction least-recently-freed first.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from sonar.core.prefix import BlockHash

__all__ = ["FreeBlockQueue", "KVBlock"]


class KVBlock:
    """One paged block of KV cache: ``block_size`` token slots in every layer."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        """How many requests' block tables hold this block; 0 means it is in the free queue."""
        self.block_hash: BlockHash | None = None
        """Set while the block is the prefix cache's entry for this hash, else None."""
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else f", hash={self.block_hash[:4].hex()}"
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}{cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) push at either end, pop and removal."""

    __slots__ = ("_head", "_tail", "num_free")

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free

    def append(self, block: KVBlock) -> None:
        """Put ``block`` at the tail: handed out (or evicted) after every block already here."""
        last = self._tail.prev
        assert last is not None
        block.prev = last
        block.next = self._tail
        last.next = block
        self._tail.prev = block
        self.num_free += 1

    def appendleft(self, block: KVBlock) -> None:
        """Put ``block`` at the head: the next block handed out."""
        first = self._head.next
        assert first is not None
        block.prev = self._head
        block.next = first
        first.prev = block
        self._head.next = block
        self.num_free += 1

    def popleft(self) -> KVBlock:
        """Take the block at the head; raise ``IndexError`` when the queue is empty."""
        block = self._head.next
        if block is self._tail or block is None:
            raise IndexError("no free KV blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        """Unlink ``block``, which must be in this queue."""
        prev, nxt = block.prev, block.next
        if prev is None or nxt is None:
            raise ValueError(f"{block!r} is not in the free queue")
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None
        self.num_free -= 1

    def __iter__(self) -> Iterator[KVBlock]:
        """Blocks from head (next out) to tail; for tests and invariant checks."""
        block = self._head.next
        while block is not None and block is not self._tail:
            yield block
            block = block.next

    def check(self) -> list[KVBlock]:
        """Walk both directions, check the links agree with the count; return the blocks."""
        forward = list(self)
        backward: list[KVBlock] = []
        block = self._tail.prev
        while block is not None and block is not self._head:
            backward.append(block)
            block = block.prev
        if len(forward) != self.num_free or backward[::-1] != forward:
            raise AssertionError(
                f"free queue links are inconsistent: count {self.num_free}, "
                f"{len(forward)} forward, {len(backward)} backward"
            )
        return forward
