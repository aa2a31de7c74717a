"""The KV block manager: per-request block tables over a shared, prefix-cached block pool.

Block ``i`` of a request holds the KV of its tokens ``[i * block_size, (i + 1) * block_size)``.
When a request is admitted, the longest run of its leading full blocks already in the prefix
cache is reused (their reference counts go up) and only the rest is computed. A block is
entered into the prefix cache as soon as the step that fills it is scheduled, so a request
admitted later in the same step (an ``n > 1`` sibling, say) can reuse it. That relies on the
model runner writing the KV of every token of a step before any attention of that step
reads the cache, which a flat batch (write all new KV of a layer, then attend) does.

Hooks for the KV offload manager and KV events (both off by default, both pure bookkeeping):

* ``kv_events=True``: every block entered into the prefix cache is logged as a ``BlockStored``
  (medium ``GPU``; parent hash, token ids and the cache salt as extra key), every entry that
  leaves it (evicted, uncached, reset) as ``BlockRemoved`` / ``AllBlocksCleared``;
  ``take_kv_events()`` hands them over in order.
* ``offload_blocks_per_chunk=n``: when a request's blocks are freed (finished, aborted,
  preempted) and ``free`` is given the request, its complete computed chunks of ``n`` blocks are
  offered for offloading (``take_kv_stores()``), unless ``offloaded_keys`` says the tiers already
  hold them. ``allocate_for_load`` / ``cache_loaded`` give a request blocks for a prefix that is
  loaded from the tiers and enter them into the prefix cache once loaded.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from sonar.core.block_pool import BlockPool
from sonar.core.events import BlockStored, KVEvent
from sonar.core.free_queue import KVBlock
from sonar.core.outputs import KVStoreSpec
from sonar.core.prefix import BlockHash, PrefixHasher, first_block_keys
from sonar.core.request import Request

__all__ = ["BlockManager"]


class BlockManager:
    """Allocates, grows, frees and prefix-matches the block tables of requests."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        hash_algo: str = "sha256",
        kv_events: bool = False,
        offload_blocks_per_chunk: int = 0,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if offload_blocks_per_chunk < 0:
            raise ValueError(f"offload_blocks_per_chunk must be >= 0, got {offload_blocks_per_chunk}")
        if offload_blocks_per_chunk and not enable_prefix_caching:
            raise ValueError("KV offloading needs prefix caching: offloaded chunks are keyed by block hashes")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.hasher: PrefixHasher | None = PrefixHasher(block_size, hash_algo) if enable_prefix_caching else None
        self._tables: dict[str, list[KVBlock]] = {}
        self._table_ids: dict[str, list[int]] = {}
        self._num_cached: dict[str, int] = {}
        """Per request: how many leading blocks have been offered to the prefix cache."""
        self._stale: set[str] = set()
        """Requests whose blocks stay out of the prefix cache: they ran across a weight update, so
        their KV mixes the old weights' and the new ones' (`drop_stale_kv`)."""
        self.prefix_queries = 0
        """Prompt tokens looked up in the prefix cache at admission (cumulative)."""
        self.prefix_hits = 0
        """Of those, tokens found cached (cumulative)."""
        self._events: list[KVEvent] | None = [] if kv_events else None
        self.pool.event_log = self._events
        self.offload_blocks_per_chunk = offload_blocks_per_chunk
        self._kv_stores: list[KVStoreSpec] = []
        self.offloaded_keys: set[BlockHash] = set()
        """Chunk keys (last block hash) offered to, or loaded from, the offload tiers and not
        reported gone since (``forget_offloaded``): not offered again."""

    @property
    def enable_prefix_caching(self) -> bool:
        return self.hasher is not None

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def usage(self) -> float:
        """Fraction of KV blocks held by requests (cached-but-free blocks count as free)."""
        return self.pool.usage()

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def update_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` over its full blocks; call after tokens are added."""
        if self.hasher is not None:
            self.hasher.extend(
                request.block_hashes,
                request.all_token_ids,
                request.cache_salt,
                request.lora_key,
                request.media,
                request.long_rope,
            )

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Cached blocks that can serve ``request``'s leading tokens, and how many tokens.

        At most ``num_tokens - 1`` tokens are reused: the last token is always computed,
        since its forward pass produces the logits to sample from. Read-only: nothing is
        referenced until ``allocate_slots`` takes the blocks.
        """
        if self.hasher is None:
            return [], 0
        limit = min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))
        cached = self.pool.cached
        hits: list[KVBlock] = []
        hashes = request.block_hashes
        for i in range(limit):
            block = cached.get(hashes[i])
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        *,
        new_computed_blocks: Sequence[KVBlock] = (),
        reserve_tokens: int = 0,
        keep_free_blocks: int = 0,
        cache_tokens: int | None = None,
    ) -> bool:
        """Give ``request`` room for ``num_new_tokens`` more tokens; False if blocks run out.

        ``new_computed_blocks`` are prefix-cache hits from ``get_computed_blocks`` (only at
        admission); they come first in the table and count as computed. The request fits
        only if, after the allocation, the pool still has ``keep_free_blocks`` free blocks
        (the watermark) and could also hold the first ``reserve_tokens`` tokens of the
        request (a full-input reservation that is checked, not allocated). On False nothing
        changed.
        """
        bs = self.block_size
        table = self._tables.get(request.request_id)
        num_existing = 0 if table is None else len(table)
        num_hits = len(new_computed_blocks)
        total_tokens = request.num_computed_tokens + num_hits * bs + num_new_tokens
        if (
            table is not None
            and not num_hits
            and not keep_free_blocks
            and max(total_tokens, reserve_tokens) <= num_existing * bs
        ):
            # The common decode step: the last block still has room.
            if self.hasher is not None:
                self._cache_full_blocks(request, table, total_tokens)
            return True
        num_new_blocks = max(0, -(-total_tokens // bs) - num_existing - num_hits)
        num_checked = max(num_new_blocks, -(-reserve_tokens // bs) - num_existing - num_hits)
        num_revived = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_checked + num_revived + keep_free_blocks > self.pool.num_free:
            return False

        if table is None:
            table = self._tables[request.request_id] = []
            ids = self._table_ids[request.request_id] = []
            self._num_cached[request.request_id] = 0
            if self.hasher is not None:
                self.prefix_queries += request.num_tokens
                self.prefix_hits += num_hits * bs
        else:
            ids = self._table_ids[request.request_id]
        if num_hits:
            self.pool.touch(new_computed_blocks)
            table.extend(new_computed_blocks)
            ids.extend(block.block_id for block in new_computed_blocks)
        if num_new_blocks:
            fresh = self.pool.allocate(num_new_blocks)
            table.extend(fresh)
            ids.extend(block.block_id for block in fresh)

        if self.hasher is not None:
            self._cache_full_blocks(request, table, total_tokens if cache_tokens is None else cache_tokens)
        return True

    def allocate_for_load(
        self,
        request: Request,
        new_computed_blocks: Sequence[KVBlock],
        num_load_blocks: int,
        *,
        reserve_tokens: int = 0,
        keep_free_blocks: int = 0,
    ) -> list[int] | None:
        """Admit ``request`` with its prefix-cache hits plus ``num_load_blocks`` fresh blocks that
        the offload tiers will fill; return those blocks' ids, or None (nothing changed) when the
        pool cannot hold them. The fresh blocks stay out of the prefix cache until
        ``cache_loaded`` (no other request may read them before the KV is there)."""
        num_hits = len(new_computed_blocks)
        if not self.allocate_slots(
            request,
            num_load_blocks * self.block_size,
            new_computed_blocks=new_computed_blocks,
            reserve_tokens=reserve_tokens,
            keep_free_blocks=keep_free_blocks,
            cache_tokens=num_hits * self.block_size,
        ):
            return None
        return self._table_ids[request.request_id][num_hits : num_hits + num_load_blocks]

    def cache_loaded(self, request: Request, num_tokens: int) -> None:
        """The KV of ``request``'s first ``num_tokens`` tokens is in its blocks now (loaded):
        enter those blocks into the prefix cache and remember their chunks are in the tiers."""
        table = self._tables[request.request_id]
        if self.hasher is not None:
            self._cache_full_blocks(request, table, num_tokens)
        bpc = self.offload_blocks_per_chunk
        if bpc:
            hashes = request.block_hashes
            for c in range(min(num_tokens // self.block_size, len(hashes)) // bpc):
                self.offloaded_keys.add(hashes[(c + 1) * bpc - 1])

    def _cache_full_blocks(self, request: Request, table: list[KVBlock], num_tokens: int) -> None:
        """Offer the blocks that the first ``num_tokens`` tokens fill to the prefix cache."""
        if request.request_id in self._stale:
            return
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        start = self._num_cached[request.request_id]
        if num_full <= start:
            return
        hashes = request.block_hashes
        cache = self.pool.cache
        if self._events is None:
            for i in range(start, num_full):
                block = table[i]
                if block.block_hash is None:
                    cache(block, hashes[i])
        else:
            run_start = -1  # a run of consecutive blocks newly cached: one BlockStored
            for i in range(start, num_full):
                block = table[i]
                if block.block_hash is None and cache(block, hashes[i]):
                    if run_start < 0:
                        run_start = i
                elif run_start >= 0:
                    self._log_stored(request, run_start, i)
                    run_start = -1
            if run_start >= 0:
                self._log_stored(request, run_start, num_full)
        self._num_cached[request.request_id] = num_full

    def _log_stored(self, request: Request, lo: int, hi: int) -> None:
        assert self._events is not None
        bs = self.block_size
        hashes = request.block_hashes
        keys = first_block_keys(request.cache_salt, request.lora_key, request.long_rope)
        self._events.append(
            BlockStored(
                block_hashes=hashes[lo:hi],
                parent_block_hash=hashes[lo - 1] if lo else None,
                token_ids=request.all_token_ids[lo * bs : hi * bs],
                block_size=bs,
                medium="GPU",
                extra_keys=[list(keys) if i == 0 else None for i in range(lo, hi)]
                if keys is not None and lo == 0
                else None,
            )
        )

    def take_kv_events(self) -> list[KVEvent]:
        """The KV events logged since the last call, in order (empty when events are off)."""
        if not self._events:
            return []
        out = list(self._events)
        self._events.clear()
        return out

    def take_kv_stores(self) -> list[KVStoreSpec]:
        """The chunks offered for offloading since the last call."""
        out, self._kv_stores = self._kv_stores, []
        return out

    @property
    def has_kv_stores(self) -> bool:
        return bool(self._kv_stores)

    def forget_offloaded(self, keys: Sequence[BlockHash]) -> None:
        """The tiers dropped these chunks: offer them again when a request frees them."""
        self.offloaded_keys.difference_update(keys)

    def _offer(self, request: Request, table: list[KVBlock], num_tokens: int) -> None:
        """Offer ``request``'s complete chunks among its first ``num_tokens`` computed tokens."""
        bpc = self.offload_blocks_per_chunk
        bs = self.block_size
        hashes = request.block_hashes
        num_full = min(num_tokens // bs, len(hashes), len(table))
        keys = self.offloaded_keys
        tokens = request.all_token_ids
        salt = request.cache_salt
        for c in range(num_full // bpc):
            lo, hi = c * bpc, (c + 1) * bpc
            key = hashes[hi - 1]
            if key in keys:
                continue
            keys.add(key)
            self._kv_stores.append(
                KVStoreSpec(
                    hashes[lo:hi],
                    hashes[lo - 1] if lo else None,
                    tokens[lo * bs : hi * bs],
                    [table[i].block_id for i in range(lo, hi)],
                    [[salt]] + [None] * (bpc - 1) if salt is not None and lo == 0 else None,
                )
            )

    def free(self, request_id: str, *, num_computed_tokens: int | None = None, request: Request | None = None) -> None:
        """Release a request's blocks, tail first so its last blocks are evicted first.

        Pass ``num_computed_tokens`` when the request is dropped before the step that
        would fill its later blocks runs (preempted in the step that scheduled it): blocks
        beyond that many tokens were entered into the cache but never computed, so they
        leave the cache here. Pass ``request`` to offer its computed chunks for offloading.
        """
        table = self._tables.pop(request_id, None)
        if table is None:
            return
        if self.offload_blocks_per_chunk and request is not None:
            computed = request.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
            self._offer(request, table, computed)
        del self._table_ids[request_id]
        del self._num_cached[request_id]
        self._stale.discard(request_id)
        if num_computed_tokens is not None:
            for block in table[num_computed_tokens // self.block_size :]:
                if block.ref_cnt == 1:
                    self.pool.uncache(block)
        self.pool.free(table[::-1])

    def has_blocks(self, request_id: str) -> bool:
        return request_id in self._tables

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table as block ids. The list is live: copy it to keep it."""
        return self._table_ids[request_id]

    def num_request_blocks(self, request_id: str) -> int:
        table = self._tables.get(request_id)
        return 0 if table is None else len(table)

    def request_ids(self) -> list[str]:
        return list(self._tables)

    def reset_prefix_cache(self) -> int:
        """Drop every prefix-cache entry (after a worker failure, say); return how many."""
        return self.pool.reset_cache()

    def drop_stale_kv(self) -> int:
        """The weights changed: drop the prefix cache, and keep the blocks of the requests holding
        blocks now out of it for good (what they compute from now on attends to KV of the old
        weights); return how many entries were dropped."""
        self._stale.update(self._tables)
        return self.pool.reset_cache()

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` unless tables, reference counts and the pool agree."""
        refs: Counter[int] = Counter()
        for request_id, table in self._tables.items():
            ids = [block.block_id for block in table]
            if ids != self._table_ids.get(request_id):
                raise AssertionError(f"block id list of {request_id!r} differs from its table")
            if len(set(ids)) != len(ids):
                raise AssertionError(f"block table of {request_id!r} holds a block twice: {ids}")
            if self._num_cached.get(request_id, 0) > len(table):
                raise AssertionError(f"{request_id!r} cached more blocks than it holds")
            refs.update(ids)
        if set(self._table_ids) != set(self._tables) or set(self._num_cached) != set(self._tables):
            raise AssertionError("per-request block bookkeeping is out of sync")
        self.pool.check_invariants(refs)
