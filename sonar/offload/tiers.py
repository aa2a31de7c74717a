"""The second-tier pools: a CPU tensor pool, a disk directory, and the store that tiers them.

Keys: a chunk is keyed by the prefix-cache hash of its *last* block. The hash chain makes that
hash cover every token before it, so one key names the whole prefix up to the chunk's end; the
chunk's other block hashes travel in its ``ChunkMeta`` (for events and for the disk header).

Tiering (``TieredStore``): a stored chunk goes into the CPU tier and, with a disk tier, is also
written to disk (write-through, so a restart finds it). A chunk the CPU tier evicts is written
to disk if the disk does not hold it yet (spill). A load reads the fastest tier holding the
chunk; a disk hit is promoted into the CPU tier. Each tier evicts by its own policy (LRU or ARC)
when it is full. A failed disk write (the disk full, an I/O error) degrades the disk tier: for
``DiskTier.RETRY_AFTER`` seconds it takes no writes (the CPU tier goes on alone; the chunks on
disk are still served), then the next write tries again.

Threads: every public method of ``TieredStore`` may be called from several threads at once. One
lock guards the indexes and the CPU pool (memory copies of one chunk happen under it); disk reads
and writes happen outside it, so a slow disk never holds up a lookup.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from sonar.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from sonar.log import get_logger
from sonar.offload.config import OffloadConfig
from sonar.offload.disk import (
    SUFFIX,
    TMP_PREFIX,
    CorruptChunk,
    DiskFile,
    ForeignChunk,
    decode_chunk,
    read_header,
    secure_directory,
    write_chunk_temp,
)
from sonar.offload.layout import KVLayout
from sonar.offload.policy import make_policy
from sonar.protocol.offload import ChunkMeta, TierStats

__all__ = ["CpuTier", "DiskTier", "TieredStore"]

log = get_logger("sonar.offload")

EmitFn = Callable[[list[KVEvent]], None]


class CpuTier:
    """A preallocated pool of chunk slots in host memory, bounded by bytes. Not thread-safe."""

    medium = "CPU"

    def __init__(self, layout: KVLayout, size_bytes: int, policy: str = "lru", *, pin_memory: bool = False) -> None:
        self.layout = layout
        self.num_slots = size_bytes // layout.chunk_bytes
        if self.num_slots < 1:
            raise ValueError(
                f"the CPU offload tier ({size_bytes} bytes) cannot hold one chunk of {layout.chunk_bytes} bytes"
            )
        # torch.empty does not touch the pages: memory is committed as chunks arrive.
        self.pool = torch.empty((self.num_slots, *layout.chunk_shape), dtype=layout.torch_dtype, pin_memory=pin_memory)
        self._free = list(range(self.num_slots - 1, -1, -1))
        self.entries: dict[bytes, tuple[int, ChunkMeta]] = {}
        self.policy = make_policy(policy, self.num_slots)
        self.stats = TierStats(self.medium, self.num_slots * layout.chunk_bytes, 0, 0)

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def put(
        self, meta: ChunkMeta, chunk: torch.Tensor, *, keep_evicted: bool
    ) -> list[tuple[ChunkMeta, torch.Tensor | None]]:
        """Copy ``chunk`` into a slot, evicting if full; returns the evicted chunks (with a copy
        of their data when ``keep_evicted``)."""
        evicted: list[tuple[ChunkMeta, torch.Tensor | None]] = []
        if not self._free:
            victim = self.policy.pop_victim()
            slot, vmeta = self.entries.pop(victim)
            evicted.append((vmeta, self.pool[slot].clone() if keep_evicted else None))
            self._free.append(slot)
            self.stats.evictions += 1
        slot = self._free.pop()
        self.pool[slot].copy_(chunk)
        self.entries[meta.key] = (slot, meta)
        self.policy.insert(meta.key)
        s = self.stats
        s.stores += 1
        s.store_bytes += self.layout.chunk_bytes
        s.chunks = len(self.entries)
        s.used_bytes = s.chunks * self.layout.chunk_bytes
        return evicted

    def get(self, key: bytes) -> torch.Tensor | None:
        entry = self.entries.get(key)
        if entry is None:
            return None
        self.policy.touch(key)
        self.stats.loads += 1
        self.stats.load_bytes += self.layout.chunk_bytes
        return self.pool[entry[0]].clone()

    def clear(self) -> list[ChunkMeta]:
        metas = [meta for _, meta in self.entries.values()]
        for key in list(self.entries):
            self.policy.remove(key)
        self.entries.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))
        self.stats.chunks = self.stats.used_bytes = 0
        return metas


class DiskTier:
    """Chunk files in a directory, bounded by bytes; indexes what it finds there on start.

    The index and accounting are not thread-safe (the store locks around them). The caller reads
    and writes file contents outside the lock (``write_chunk_temp``, ``read``); renames and
    deletes, which touch a key's one path, happen under it.
    """

    medium = "DISK"

    RETRY_AFTER = 30.0
    """Seconds a degraded tier (a write failed) takes no writes before it tries again."""

    def __init__(
        self, layout: KVLayout, root: str | Path, size_bytes: int, policy: str = "lru", *, fsync: bool = True
    ) -> None:
        self.layout = layout
        self.root = Path(root)
        if secure_directory(self.root):
            log.warning(
                "offload.disk.readable_by_others",
                path=str(self.root),
                detail="chunk files are created 0600, but their names show which prefixes are cached",
            )
        self.fsync = fsync
        self.retry_at = 0.0
        """While degraded: when (``time.monotonic``) a write may be tried again."""
        self.size_bytes = size_bytes
        self.index: dict[bytes, DiskFile] = {}
        self.used = 0
        self.policy = make_policy(policy, max(1, size_bytes // layout.chunk_bytes))
        self.stats = TierStats(self.medium, size_bytes, 0, 0)

    def __contains__(self, key: bytes) -> bool:
        return key in self.index

    def scan(self) -> tuple[list[DiskFile], list[Path]]:
        """Index the chunk files already in the directory (headers only, oldest first).

        Returns the indexed files and the files to delete (corrupt ones, and the oldest ones
        beyond the size limit); stale temporary files are removed here.
        """
        found: list[tuple[float, DiskFile]] = []
        doomed: list[Path] = []
        for entry in os.scandir(self.root):
            name = entry.name
            if name.startswith(TMP_PREFIX):
                Path(entry.path).unlink(missing_ok=True)
                continue
            if not name.endswith(SUFFIX) or not entry.is_file(follow_symlinks=False):
                continue
            path = Path(entry.path)
            try:
                with open(path, "rb") as f:
                    header, _ = read_header(f)
                if header.identity != self.layout:
                    raise ForeignChunk("identity differs")
                if header.meta.key.hex() + SUFFIX != name:
                    raise CorruptChunk("file name and header key differ")
                if len(header.meta.block_hashes) != self.layout.blocks_per_chunk:
                    raise CorruptChunk("wrong number of block hashes")
                st = entry.stat()
                found.append((st.st_mtime, DiskFile(path, st.st_size, header.meta)))
            except ForeignChunk:
                self.stats.foreign += 1
                log.warning("offload.disk.foreign", path=str(path), action="ignored")
            except (CorruptChunk, OSError) as exc:
                self.stats.corrupt += 1
                log.warning("offload.disk.corrupt", path=str(path), error=str(exc), action="deleted")
                doomed.append(path)
        found.sort(key=lambda item: item[0])
        indexed: list[DiskFile] = []
        for _, file in found:
            doomed += [f.path for f in self.add(file, count=False)]
            indexed.append(file)
        indexed = [f for f in indexed if f.meta.key in self.index]
        return indexed, doomed

    def add(self, file: DiskFile, *, count: bool = True) -> list[DiskFile]:
        """Index a written file; returns the files evicted to stay under the limit (to delete)."""
        key = file.meta.key
        old = self.index.pop(key, None)
        if old is not None:
            self.used -= old.nbytes
            self.policy.remove(key)
        evicted: list[DiskFile] = []
        while self.index and self.used + file.nbytes > self.size_bytes:
            victim = self.index.pop(self.policy.pop_victim())
            self.used -= victim.nbytes
            evicted.append(victim)
            self.stats.evictions += 1
        if file.nbytes > self.size_bytes:
            evicted.append(file)  # larger than the whole tier: never kept
        else:
            self.index[key] = file
            self.used += file.nbytes
            self.policy.insert(key)
            if count:
                self.stats.stores += 1
                self.stats.store_bytes += file.nbytes
        self._account()
        return evicted

    def drop(self, key: bytes) -> DiskFile | None:
        file = self.index.pop(key, None)
        if file is not None:
            self.used -= file.nbytes
            self.policy.remove(key)
            self._account()
        return file

    def _account(self) -> None:
        self.stats.chunks = len(self.index)
        self.stats.used_bytes = self.used

    @property
    def writable(self) -> bool:
        """Writes are on: the tier is not degraded, or its pause after a failed write is over."""
        return not self.stats.degraded or time.monotonic() >= self.retry_at

    def write_failed(self, key: bytes, exc: OSError) -> None:
        """A write failed (disk full, I/O error): count it and take no writes for ``RETRY_AFTER``
        seconds; the chunk stays in the faster tier only, and every request is still served."""
        self.stats.write_errors += 1
        if not self.stats.degraded:
            log.warning(
                "offload.disk.degraded",
                path=str(self.root),
                key=key.hex(),
                error=errno.errorcode.get(exc.errno or 0, "") or str(exc),
                detail=str(exc),
                retry_after_s=self.RETRY_AFTER,
            )
        self.stats.degraded = True
        self.retry_at = time.monotonic() + self.RETRY_AFTER

    def write_succeeded(self) -> None:
        if self.stats.degraded:
            self.stats.degraded = False
            log.info("offload.disk.recovered", path=str(self.root), write_errors=self.stats.write_errors)

    def read(self, file: DiskFile) -> torch.Tensor:
        """Read and verify a chunk file (outside the lock); raises Corrupt/ForeignChunk, OSError."""
        _, tensor = decode_chunk(file.path, self.layout, file.meta.key)
        return tensor


class TieredStore:
    """The CPU tier, optionally backed by a disk tier: stores, lookups, loads, eviction, events."""

    def __init__(self, layout: KVLayout, config: OffloadConfig, emit: EmitFn | None = None) -> None:
        if layout.blocks_per_chunk != config.blocks_per_chunk:
            raise ValueError("the layout's blocks_per_chunk differs from the offload config's")
        self.layout = layout
        self.bpc = layout.blocks_per_chunk
        self._emit = emit or (lambda events: None)
        self._lock = threading.RLock()
        """Guards the indexes and the CPU pool; reentrant so a caller can hold it across
        ``contents()`` and its own bookkeeping of the events emitted under it (a consistent snapshot)."""
        cpu_bytes = config.cpu_bytes
        self.cpu = CpuTier(layout, cpu_bytes, config.eviction_policy)
        disk = config.disk
        self.disk = (
            DiskTier(layout, disk.path, disk.size_bytes, config.eviction_policy, fsync=disk.fsync) if disk else None
        )
        self.lookups = 0
        self.lookup_blocks = 0
        self.hit_blocks = 0
        self.duplicate_stores = 0
        events: list[KVEvent] = [AllBlocksCleared("CPU")]
        if self.disk is not None:
            indexed, doomed = self.disk.scan()
            for path in doomed:
                path.unlink(missing_ok=True)
            events.append(AllBlocksCleared("DISK"))
            events += [self._stored(f.meta, "DISK") for f in indexed]
            log.info(
                "offload.disk.indexed",
                path=str(self.disk.root),
                chunks=len(indexed),
                bytes=self.disk.used,
                corrupt=self.disk.stats.corrupt,
                foreign=self.disk.stats.foreign,
            )
        self._emit(events)

    # -- events ---------------------------------------------------------------------------------
    def _stored(self, meta: ChunkMeta, medium: str) -> BlockStored:
        return BlockStored(
            block_hashes=list(meta.block_hashes),
            parent_block_hash=meta.parent_hash,
            token_ids=list(meta.token_ids),
            block_size=self.layout.block_size,
            medium=medium,
            extra_keys=meta.extra_keys,
        )

    @staticmethod
    def _removed(metas: Sequence[ChunkMeta], medium: str) -> BlockRemoved:
        return BlockRemoved([h for m in metas for h in m.block_hashes], medium)

    # -- store ----------------------------------------------------------------------------------
    def store(self, metas: Sequence[ChunkMeta], data: torch.Tensor | Sequence[torch.Tensor]) -> int:
        """Keep chunks (``data[i]`` holds ``metas[i]``); returns how many were new."""
        new = 0
        for meta, chunk in zip(metas, data, strict=True):
            self._check(meta, chunk)
            to_disk: list[tuple[ChunkMeta, torch.Tensor]] = []
            with self._lock:
                key = meta.key
                on_disk = self.disk is not None and key in self.disk
                if key in self.cpu:
                    self.cpu.policy.touch(key)
                    self.duplicate_stores += 1
                    if on_disk:
                        self.disk.policy.touch(key)
                    continue
                new += 1
                to_disk = self._put_cpu(meta, chunk)
                if self.disk is not None and not on_disk and self.disk.writable:
                    to_disk.insert(0, (meta, chunk))
            for dmeta, dchunk in to_disk:
                self._write_disk(dmeta, dchunk)
        return new

    def _check(self, meta: ChunkMeta, chunk: torch.Tensor) -> None:
        if len(meta.block_hashes) != self.bpc:
            raise ValueError(f"a chunk has {self.bpc} block hashes, got {len(meta.block_hashes)}")
        if len(meta.token_ids) != self.layout.chunk_tokens:
            raise ValueError(f"a chunk has {self.layout.chunk_tokens} token ids, got {len(meta.token_ids)}")
        if tuple(chunk.shape) != self.layout.chunk_shape or chunk.dtype != self.layout.torch_dtype:
            raise ValueError(
                f"a chunk tensor is {self.layout.chunk_shape} {self.layout.dtype}, got "
                f"{tuple(chunk.shape)} {chunk.dtype}"
            )

    def _put_cpu(self, meta: ChunkMeta, chunk: torch.Tensor) -> list[tuple[ChunkMeta, torch.Tensor]]:
        """Under the lock: put into the CPU tier, emit; return evicted chunks the disk lacks."""
        disk = self.disk if self.disk is not None and self.disk.writable else None
        evicted = self.cpu.put(meta, chunk, keep_evicted=disk is not None)
        events: list[KVEvent] = [self._stored(meta, "CPU")]
        spill: list[tuple[ChunkMeta, torch.Tensor]] = []
        if evicted:
            events.append(self._removed([m for m, _ in evicted], "CPU"))
            if disk is not None:
                spill = [(m, t) for m, t in evicted if m.key not in disk and t is not None]
        self._emit(events)
        return spill

    def _write_disk(self, meta: ChunkMeta, chunk: torch.Tensor) -> None:
        """Write one chunk under a temporary name (outside the lock), then rename it into place,
        index it and delete what it evicts (under the lock: file names are the chunk keys, so a
        rename and a delete of the same key must not interleave)."""
        disk = self.disk
        assert disk is not None
        if not disk.writable:  # an earlier write of this store failed meanwhile
            return
        try:
            pending = write_chunk_temp(disk.root, self.layout, meta, chunk, fsync=disk.fsync)
        except OSError as exc:
            with self._lock:
                disk.write_failed(meta.key, exc)
            return
        with self._lock:
            try:
                file = pending.commit()
            except OSError as exc:
                pending.discard()
                disk.write_failed(meta.key, exc)
                return
            disk.write_succeeded()
            replaced = meta.key in disk
            evicted = disk.add(file)
            gone = [f for f in evicted if f is not file]
            events: list[KVEvent] = []
            if gone:
                events.append(self._removed([f.meta for f in gone], "DISK"))
            if meta.key in disk and not replaced:
                events.append(self._stored(meta, "DISK"))
            self._emit(events)
            for f in evicted:  # victims, or the new file itself when it exceeds the whole tier
                f.path.unlink(missing_ok=True)

    # -- lookup / load --------------------------------------------------------------------------
    def lookup(self, block_hashes: Sequence[bytes]) -> tuple[int, list[str]]:
        """Leading blocks of the sequence held by the tiers (whole chunks), and each chunk's tier."""
        bpc = self.bpc
        mediums: list[str] = []
        with self._lock:
            self.lookups += 1
            self.lookup_blocks += len(block_hashes)
            for c in range(len(block_hashes) // bpc):
                key = block_hashes[(c + 1) * bpc - 1]
                if key in self.cpu:
                    mediums.append("CPU")
                    self.cpu.stats.hit_blocks += bpc
                elif self.disk is not None and key in self.disk:
                    mediums.append("DISK")
                    self.disk.stats.hit_blocks += bpc
                else:
                    break
            self.hit_blocks += len(mediums) * bpc
        return len(mediums) * bpc, mediums

    def load(self, block_hashes: Sequence[bytes], start_block: int = 0) -> tuple[int, list[torch.Tensor], list[str]]:
        """The chunks covering blocks ``start_block ..`` of the sequence, leading ones that exist.

        Returns (first chunk index, chunk tensors, the tier each came from). Stops at the first
        chunk no tier holds (or whose file turns out corrupt).
        """
        bpc = self.bpc
        if not 0 <= start_block <= len(block_hashes):
            raise ValueError(f"start_block {start_block} is outside the {len(block_hashes)} blocks given")
        first = start_block // bpc
        chunks: list[torch.Tensor] = []
        mediums: list[str] = []
        promote: list[tuple[ChunkMeta, torch.Tensor]] = []
        for c in range(first, len(block_hashes) // bpc):
            key = block_hashes[(c + 1) * bpc - 1]
            file: DiskFile | None = None
            with self._lock:
                tensor = self.cpu.get(key)
                if tensor is None and self.disk is not None:
                    file = self.disk.index.get(key)
                    if file is not None:
                        self.disk.policy.touch(key)
            if tensor is not None:
                chunks.append(tensor)
                mediums.append("CPU")
                continue
            if file is None:
                break
            tensor = self._read_disk(file)
            if tensor is None:
                break
            chunks.append(tensor)
            mediums.append("DISK")
            promote.append((file.meta, tensor))
        # Promote once the whole load is read, so promotions never evict chunks of this same load.
        for meta, tensor in promote:
            self._promote(meta, tensor)
        return first, chunks, mediums

    def _read_disk(self, file: DiskFile) -> torch.Tensor | None:
        disk = self.disk
        assert disk is not None
        try:
            tensor = disk.read(file)
        except FileNotFoundError:  # evicted (and deleted) since the index was read
            with self._lock:
                if disk.index.get(file.meta.key) is file:
                    disk.drop(file.meta.key)
                    self._emit([self._removed([file.meta], "DISK")])
            return None
        except (CorruptChunk, ForeignChunk, OSError) as exc:
            kind = "foreign" if isinstance(exc, ForeignChunk) else "corrupt"
            log.warning(f"offload.disk.{kind}", path=str(file.path), error=str(exc), action="dropped")
            with self._lock:
                if kind == "foreign":
                    disk.stats.foreign += 1
                else:
                    disk.stats.corrupt += 1
                if disk.index.get(file.meta.key) is file:
                    disk.drop(file.meta.key)
                    self._emit([self._removed([file.meta], "DISK")])
                    if kind == "corrupt":  # a newer file of the same key, if any, is not ours to delete
                        file.path.unlink(missing_ok=True)
            return None
        with self._lock:
            disk.stats.loads += 1
            disk.stats.load_bytes += file.nbytes
        return tensor

    def _promote(self, meta: ChunkMeta, chunk: torch.Tensor) -> None:
        with self._lock:
            if meta.key in self.cpu:
                return
            spill = self._put_cpu(meta, chunk)
        for smeta, schunk in spill:
            self._write_disk(smeta, schunk)

    def count_hits(self, mediums: Sequence[str]) -> None:
        """Count served chunks (their tiers in order) as one lookup's hits, for a caller that looked
        them up elsewhere (in a mirror of the tiers)."""
        with self._lock:
            self.lookups += 1
            self.hit_blocks += len(mediums) * self.bpc
            for medium in mediums:
                tier = self.cpu if medium == "CPU" else self.disk
                if tier is not None:
                    tier.stats.hit_blocks += self.bpc

    # -- views ----------------------------------------------------------------------------------
    def contents(self) -> dict[str, list[bytes]]:
        """Block hashes per tier (``CPU``, ``DISK``)."""
        with self._lock:
            out = {"CPU": [h for _, m in self.cpu.entries.values() for h in m.block_hashes]}
            if self.disk is not None:
                out["DISK"] = [h for f in self.disk.index.values() for h in f.meta.block_hashes]
        return out

    def clear(self, *, disk: bool = False) -> int:
        doomed: list[DiskFile] = []
        with self._lock:
            n = len(self.cpu.clear())
            events: list[KVEvent] = [AllBlocksCleared("CPU")]
            if disk and self.disk is not None:
                doomed = list(self.disk.index.values())
                for f in doomed:
                    self.disk.drop(f.meta.key)
                n += len(doomed)
                events.append(AllBlocksCleared("DISK"))
            self._emit(events)
            for f in doomed:
                f.path.unlink(missing_ok=True)
        return n

    def tier_stats(self) -> list[TierStats]:
        with self._lock:
            tiers = [self.cpu.stats] + ([self.disk.stats] if self.disk is not None else [])
            return [type(t)(**{f: getattr(t, f) for f in t.__struct_fields__}) for t in tiers]
