"""The disk tier: one file per chunk in a directory, size-limited, checked on every read.

File ``<dir>/<key hex>.kvchunk``::

    magic  b"SONARKVC"            8 bytes
    u32    header length          little endian
    header msgpack ``ChunkHeader``: the layout identity, the key, the block hashes, the parent
           hash, the token ids, the extra keys, the payload length
    payload the chunk tensor's bytes (C order, ``KVLayout.chunk_shape``, ``KVLayout.dtype``)
    digest xxh3-128 of header + payload   16 bytes

Files are written to a temporary name (mode 0600), flushed to the disk (``fsync``, unless the
config turns it off) and renamed, so a crash never leaves a half-written chunk under a real name.
The directory is created 0700; an existing one must belong to this user and be writable by
nobody else (a chunk file holds prompt token ids, and its KV is served as is), else the tier
refuses to start. On start the directory is indexed from the headers alone (fast); the digest
is checked on every read. A file whose header or digest is wrong is *corrupt*: deleted and
counted. A file whose identity (model, dtype, layout, block size, hash algorithm, format
version) differs is *foreign*: never indexed nor served, and left in place (another deployment
may own it). Neither is ever served.
"""

from __future__ import annotations

import os
import stat
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch
import xxhash

from sonar.errors import SonarError
from sonar.offload.layout import KVLayout
from sonar.protocol.offload import ChunkMeta

__all__ = [
    "ChunkHeader",
    "CorruptChunk",
    "DiskFile",
    "ForeignChunk",
    "UnsafeDirectoryError",
    "decode_chunk",
    "encode_chunk",
    "secure_directory",
]

MAGIC = b"SONARKVC"
SUFFIX = ".kvchunk"
TMP_PREFIX = ".tmp-"
_LEN = struct.Struct("<I")
DIGEST_BYTES = 16


class ChunkHeader(msgspec.Struct, frozen=True):
    identity: KVLayout
    meta: ChunkMeta
    payload_bytes: int


class CorruptChunk(SonarError, ValueError):
    """The file is damaged (bad magic, header, length or digest)."""


class ForeignChunk(SonarError, ValueError):
    """The file is intact but holds KV of another model, dtype, layout or format."""


_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(ChunkHeader)


def encode_chunk(layout: KVLayout, meta: ChunkMeta, chunk: torch.Tensor) -> list[bytes | memoryview]:
    """The pieces of a chunk file, in order (written with one ``writelines``)."""
    if tuple(chunk.shape) != layout.chunk_shape or chunk.dtype != layout.torch_dtype:
        raise ValueError(f"chunk must be {layout.chunk_shape} {layout.dtype}, got {tuple(chunk.shape)} {chunk.dtype}")
    data = chunk.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    payload = memoryview(data)
    header = _encoder.encode(ChunkHeader(layout, meta, payload.nbytes))
    digest = xxhash.xxh3_128()
    digest.update(header)
    digest.update(payload)
    return [MAGIC, _LEN.pack(len(header)), header, payload, digest.digest()]


def read_header(f) -> tuple[ChunkHeader, bytes]:
    """Read and decode the header at the start of an open file; returns it and its raw bytes."""
    start = f.read(len(MAGIC) + _LEN.size)
    if len(start) != len(MAGIC) + _LEN.size or start[: len(MAGIC)] != MAGIC:
        raise CorruptChunk("bad magic")
    (length,) = _LEN.unpack(start[len(MAGIC) :])
    raw = f.read(length)
    if len(raw) != length:
        raise CorruptChunk("truncated header")
    try:
        return _header_decoder.decode(raw), raw
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raise CorruptChunk(f"undecodable header: {exc}") from None


def decode_chunk(path: Path, layout: KVLayout, key: bytes | None = None) -> tuple[ChunkMeta, torch.Tensor]:
    """Read a chunk file and check everything; raise ``CorruptChunk`` or ``ForeignChunk``."""
    with open(path, "rb") as f:
        header, raw_header = read_header(f)
        if header.identity != layout:
            raise ForeignChunk(f"identity {header.identity} differs from {layout}")
        if header.payload_bytes != layout.chunk_bytes:
            raise CorruptChunk(f"payload of {header.payload_bytes} bytes, expected {layout.chunk_bytes}")
        if key is not None and header.meta.key != key:
            raise CorruptChunk("the header names another key than the file")
        payload = bytearray(header.payload_bytes)
        if f.readinto(payload) != len(payload):
            raise CorruptChunk("truncated payload")
        digest = f.read(DIGEST_BYTES + 1)
    if len(digest) != DIGEST_BYTES:
        raise CorruptChunk("missing or oversized digest")
    check = xxhash.xxh3_128()
    check.update(raw_header)
    check.update(payload)
    if check.digest() != digest:
        raise CorruptChunk("digest mismatch")
    tensor = torch.frombuffer(payload, dtype=torch.uint8).view(layout.torch_dtype).reshape(layout.chunk_shape)
    return header.meta, tensor


@dataclass(slots=True)
class DiskFile:
    """An indexed chunk file."""

    path: Path
    nbytes: int
    meta: ChunkMeta


def chunk_path(root: Path, key: bytes) -> Path:
    return root / f"{key.hex()}{SUFFIX}"


@dataclass(slots=True)
class PendingFile:
    """A chunk written under a temporary name, not yet renamed to its final one."""

    tmp: Path
    file: DiskFile

    def commit(self) -> DiskFile:
        """Rename into place (atomic). Callers that index files do it under their index's lock,
        so a rename can never land after, and be undone by, a delete of the same key's path."""
        os.replace(self.tmp, self.file.path)
        return self.file

    def discard(self) -> None:
        self.tmp.unlink(missing_ok=True)


def write_chunk_temp(
    root: Path, layout: KVLayout, meta: ChunkMeta, chunk: torch.Tensor, *, fsync: bool = True
) -> PendingFile:
    """Write a chunk under a temporary name (the slow part, outside any lock); `commit` renames it.

    The file is created 0600 (never through a symlink) and, with ``fsync``, on the disk before
    the rename, so a power loss cannot leave a renamed file whose data never reached the disk.
    An ``OSError`` (a full disk: ENOSPC, EDQUOT, EFBIG) leaves no file behind."""
    pieces = encode_chunk(layout, meta, chunk)
    tmp = root / f"{TMP_PREFIX}{meta.key.hex()}-{uuid.uuid4().hex[:8]}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
        with open(fd, "wb") as f:
            f.writelines(pieces)
            f.flush()
            nbytes = f.tell()
            if fsync:
                os.fsync(f.fileno())
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    return PendingFile(tmp, DiskFile(chunk_path(root, meta.key), nbytes, meta))


def write_chunk_file(
    root: Path, layout: KVLayout, meta: ChunkMeta, chunk: torch.Tensor, *, fsync: bool = True
) -> DiskFile:
    """Write a chunk atomically (temporary name, then rename); return its index entry."""
    return write_chunk_temp(root, layout, meta, chunk, fsync=fsync).commit()


class UnsafeDirectoryError(SonarError, ValueError):
    """The disk tier's directory belongs to another user, or others may write to it."""


def secure_directory(root: Path) -> bool:
    """Create ``root`` (mode 0700, parents as needed) unless it exists, then check it: a directory
    this user owns that neither its group nor others may write to (else ``UnsafeDirectoryError``:
    whoever can write there can plant KV that is served to every request with that prefix).
    Returns whether group or others may still read or enter it (the caller warns)."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = root.stat()
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectoryError(f"the disk tier path {root} is not a directory")
    if st.st_uid != os.geteuid():
        raise UnsafeDirectoryError(
            f"the disk tier directory {root} belongs to uid {st.st_uid}, not to this process (uid {os.geteuid()}): "
            "refusing it; give the server a directory of its own (it is created 0700 when missing)"
        )
    if mode & 0o022:
        raise UnsafeDirectoryError(
            f"the disk tier directory {root} is writable by its group or others (mode {mode:04o}): refusing it; "
            f"chmod 700 {root}"
        )
    return bool(mode & 0o077)
