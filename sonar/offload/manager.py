"""The KV offload manager actor: second-tier pools behind a typed mailbox, and the KV events.

The mailbox loop only touches in-memory indexes (``Lookup``, ``GetOffloadStats``, ...); every
store and load runs in a task of its own on a worker thread (at most ``io_threads`` at once), so
a slow disk read never holds up a lookup. ``Load`` answers when its I/O is done (the reply comes
from that task); ``Flush`` answers once everything received before it has finished.

Restarted by its supervisor, the manager starts empty in the CPU tier and re-indexes the disk
tier's directory; the events it publishes start with ``AllBlocksCleared`` for its media, then a
``BlockStored`` for every chunk found on disk.

Besides publishing them, the manager keeps its tiers' own events (``CPU``, ``DISK``) in a
numbered log for ``WatchTiers``: the scheduler long-polls it to keep the mirror its synchronous
lookups read. A watcher from another run of the manager (``epoch``) or too far behind gets a
snapshot instead, so a restart of either side resynchronizes it.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from typing import Any

import anyio
import anyio.to_thread
import msgspec
import torch

from sonar.actors import NO_REPLY, Actor
from sonar.actors.messages import RemoteError
from sonar.actors.node import get_node
from sonar.core.events import KVEvent
from sonar.log import get_logger
from sonar.offload.config import KVEventsConfig, OffloadConfig
from sonar.offload.events import KVEventPublisher
from sonar.offload.layout import KVLayout
from sonar.offload.tiers import TieredStore
from sonar.protocol.engine import DescribeWorker
from sonar.protocol.offload import (
    Clear,
    Flush,
    GetOffloadStats,
    LatencyHistogram,
    Load,
    LoadResult,
    Lookup,
    LookupResult,
    OffloadMsg,
    OffloadStats,
    PublishEvents,
    Store,
    TierContents,
    TierUpdate,
    WatchTiers,
)

__all__ = ["OffloadManagerActor"]

log = get_logger("sonar.offload")


class OffloadManagerActor(Actor):
    """Owns the CPU (and disk) tiers of one engine and its KV events publisher.

    Construction arguments are plain data so the actor can live in another process:
    ``config`` an ``OffloadConfig`` (None: no tiers, the actor only publishes events),
    ``layout`` the ``KVLayout`` of the engine's cache, ``events`` a ``KVEventsConfig`` (or None:
    no events). Instead of ``layout``, ``worker`` (the worker's ActorRef) lets the manager build
    it from ``DescribeWorker`` when it starts, with ``hash_algo`` the prefix-cache hash algorithm.
    """

    protocol = OffloadMsg

    TIER_LOG_MAX = 100_000
    """Tier events kept for ``WatchTiers``; a watcher further behind gets a snapshot."""

    def __init__(
        self,
        config: dict[str, Any] | None,
        layout: dict[str, Any] | None = None,
        events: dict[str, Any] | None = None,
        worker: Any = None,
        hash_algo: str = "sha256",
    ) -> None:
        self.config = None if config is None else msgspec.convert(config, OffloadConfig)
        self.layout = None if layout is None else msgspec.convert(layout, KVLayout)
        self.worker = worker
        self.hash_algo = hash_algo
        if self.config is not None and self.layout is None and worker is None:
            raise ValueError("the offload manager needs the KV layout of the engine's cache (or the worker to ask)")
        self.epoch = secrets.token_hex(8)
        self._tier_lock = threading.Lock()
        self._tier_log: list[KVEvent] = []
        self._tier_base = 0
        """The sequence number of ``_tier_log[0]``."""
        self._watchers: list[tuple[WatchTiers, float]] = []
        self._changed = anyio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.events_config = msgspec.convert(events, KVEventsConfig) if events else None
        self.publisher = None
        self.pending = 0
        self.completed = 0
        self._idle = anyio.Event()
        self._idle.set()
        self.latency: dict[str, LatencyHistogram] = {}

    async def started(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.config is not None and self.layout is None:
            info = await self.worker.ask(DescribeWorker(), timeout=120)
            self.layout = KVLayout(
                model=info.model,
                dtype=info.dtype,
                num_layers=info.num_layers,
                num_kv_heads=info.num_kv_heads,
                head_dim=info.head_dim,
                block_size=info.block_size,
                blocks_per_chunk=self.config.blocks_per_chunk,
                hash_algo=self.hash_algo,
            )
        if self.events_config is not None and self.events_config.active:
            self.publisher = await anyio.to_thread.run_sync(KVEventPublisher, self.events_config)
        self.limiter = anyio.CapacityLimiter(2 if self.config is None else self.config.io_threads)
        if self.config is None:
            self.store = None
            log.info("offload.ready", tiers=None, events=None if self.publisher is None else self.publisher.endpoint)
            return
        # Scanning a large disk directory takes a while: off the event loop.
        self.store = await anyio.to_thread.run_sync(TieredStore, self.layout, self.config, self._emit)
        log.info(
            "offload.ready",
            spec=self.config.spec_name,
            blocks_per_chunk=self.layout.blocks_per_chunk,
            cpu_chunks=self.store.cpu.num_slots,
            disk=None if self.store.disk is None else str(self.store.disk.root),
            events=None if self.publisher is None else self.publisher.endpoint,
        )

    async def stopping(self) -> None:
        with anyio.move_on_after(10):
            await self._idle.wait()
        if self.publisher is not None:
            await anyio.to_thread.run_sync(self.publisher.close)
            self.publisher = None

    def _emit(self, events: list[KVEvent]) -> None:
        """The tiers' events (from any thread): publish them and log them for the watchers."""
        if not events:
            return
        if self.publisher is not None:
            self.publisher.publish(events)
        with self._tier_lock:
            self._tier_log += events
            extra = len(self._tier_log) - self.TIER_LOG_MAX
            if extra > 0:
                del self._tier_log[:extra]
                self._tier_base += extra
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(lambda: self._changed.set())  # the Event current when it runs
            except RuntimeError:  # the loop closed meanwhile (the actor stopped): nobody watches
                pass

    # -- tier watchers --------------------------------------------------------------------------
    def _update_for(self, msg: WatchTiers) -> TierUpdate | None:
        """The answer to a watcher now, or None when it has nothing new (it waits)."""
        with self._tier_lock:
            end = self._tier_base + len(self._tier_log)
            if msg.epoch == self.epoch and self._tier_base <= msg.since <= end:
                if msg.since == end:
                    return None
                return TierUpdate(self.epoch, end, self._tier_log[msg.since - self._tier_base :])
        return self._snapshot()

    def _snapshot(self) -> TierUpdate:
        if self.store is None:
            return TierUpdate(self.epoch, 0, [], {})
        # The store emits under its (reentrant) lock: holding it, the contents and the log agree.
        with self.store._lock:
            contents = self.store.contents()
            with self._tier_lock:
                end = self._tier_base + len(self._tier_log)
        return TierUpdate(self.epoch, end, [], contents)

    async def run(self) -> None:
        """Answer parked watchers when the tiers change, or with nothing when their wait is over."""
        while True:
            with anyio.move_on_after(0.25):
                await self._changed.wait()
            self._changed = anyio.Event()
            if not self._watchers:
                continue
            now = time.monotonic()
            waiting = []
            for msg, deadline in self._watchers:
                update = self._update_for(msg)
                if update is None and now >= deadline:
                    update = TierUpdate(self.epoch, msg.since, [])
                if update is None:
                    waiting.append((msg, deadline))
                else:
                    await self.reply(msg.reply_to, update)
            self._watchers = waiting

    # -- background I/O -------------------------------------------------------------------------
    def _begin(self) -> None:
        if self.pending == 0:
            self._idle = anyio.Event()
        self.pending += 1

    def _end(self) -> None:
        self.pending -= 1
        self.completed += 1
        if self.pending == 0:
            self._idle.set()

    async def _store(self, msg: Store) -> None:
        try:
            data = msg.data
            if isinstance(data, torch.Tensor) and data.dim() == len(self.layout.chunk_shape):
                data = data.unsqueeze(0)
            async with self.limiter:
                await anyio.to_thread.run_sync(self.store.store, msg.chunks, data)
        except Exception as exc:  # a bad store is dropped, not fatal: the blocks are just not offloaded
            log.error("offload.store_failed", error=f"{type(exc).__name__}: {exc}", chunks=len(msg.chunks))
        finally:
            self._end()

    async def _load(self, msg: Load) -> None:
        started = time.perf_counter()
        try:
            async with self.limiter:
                first, chunks, mediums = await anyio.to_thread.run_sync(
                    self.store.load, msg.block_hashes, msg.start_block
                )
            bpc = self.layout.blocks_per_chunk
            if msg.count_hits and mediums:
                self.store.count_hits(mediums)
            data = torch.stack(chunks) if chunks else None
            num_blocks = min((first + len(chunks)) * bpc, len(msg.block_hashes)) if chunks else 0
            result = LoadResult(first, data, mediums, num_blocks, msg.start_block - first * bpc)
            if mediums:
                medium = "DISK" if "DISK" in mediums else "CPU"
                hist = self.latency.get(medium)
                if hist is None:
                    hist = self.latency[medium] = LatencyHistogram.empty()
                hist.observe(time.perf_counter() - started)
            await self.reply(msg.reply_to, result)
        except Exception as exc:
            await get_node().reply(msg.reply_to, error=RemoteError.from_exception(exc))
        finally:
            self._end()

    async def _flush(self, msg: Flush) -> None:
        await self._idle.wait()
        await self.reply(msg.reply_to, self.completed)

    # -- the mailbox ----------------------------------------------------------------------------
    async def handle(self, msg: OffloadMsg) -> Any:
        if self.store is None:
            return self._handle_without_tiers(msg)
        if isinstance(msg, Lookup):
            num_blocks, mediums = self.store.lookup(msg.block_hashes)
            return LookupResult(num_blocks, mediums)
        if isinstance(msg, Store):
            self._begin()
            self.task_group.start_soon(self._store, msg)
            return None
        if isinstance(msg, Load):
            self._begin()
            self.task_group.start_soon(self._load, msg)
            return NO_REPLY
        if isinstance(msg, PublishEvents):
            self._emit(list(msg.events))
            return None
        if isinstance(msg, GetOffloadStats):
            return self.stats()
        if isinstance(msg, Flush):
            if self.pending == 0:
                return self.completed
            self.task_group.start_soon(self._flush, msg)
            return NO_REPLY
        if isinstance(msg, TierContents):
            return self.store.contents()
        if isinstance(msg, Clear):
            await self._idle.wait()
            return await anyio.to_thread.run_sync(lambda: self.store.clear(disk=msg.disk))
        if isinstance(msg, WatchTiers):
            update = self._update_for(msg)
            if update is not None:
                return update
            self._watchers.append((msg, time.monotonic() + max(0.0, msg.wait)))
            return NO_REPLY
        raise TypeError(f"unexpected {type(msg).__name__}")

    def _handle_without_tiers(self, msg: OffloadMsg) -> Any:
        """Events-only mode: every lookup misses, stores are dropped."""
        if isinstance(msg, PublishEvents):
            self._emit(list(msg.events))
            return None
        if isinstance(msg, Lookup):
            return LookupResult(0, [])
        if isinstance(msg, Load):
            return LoadResult(
                msg.start_block // max(1, self.layout.blocks_per_chunk if self.layout else 1), None, [], 0
            )
        if isinstance(msg, (Flush, Clear)):
            return 0
        if isinstance(msg, GetOffloadStats):
            return OffloadStats(tiers=[], events_dropped=self._events_dropped())
        if isinstance(msg, TierContents):
            return {}
        if isinstance(msg, WatchTiers):
            return TierUpdate(self.epoch, 0, [], {})
        return None  # Store: nowhere to keep it

    def stats(self) -> OffloadStats:
        s = self.store
        return OffloadStats(
            tiers=s.tier_stats(),
            lookups=s.lookups,
            lookup_blocks=s.lookup_blocks,
            hit_blocks=s.hit_blocks,
            duplicate_stores=s.duplicate_stores,
            load_latency={m: msgspec.structs.replace(h, counts=list(h.counts)) for m, h in self.latency.items()},
            pending_io=self.pending,
            events_dropped=self._events_dropped(),
        )

    def _events_dropped(self) -> int:
        return 0 if self.publisher is None else self.publisher.dropped
