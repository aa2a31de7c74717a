"""Small real layouts, hash chains and chunks for the offload tests (importable by child processes)."""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from sonar.core.prefix import PrefixHasher
from sonar.offload.config import OffloadConfig, TierConfig
from sonar.offload.disk import encode_chunk
from sonar.offload.layout import KVLayout
from sonar.protocol.offload import ChunkMeta

BLOCK = 4


def layout(bpc: int = 1, **changes: object) -> KVLayout:
    fields = dict(
        model="tiny-test",
        dtype="float32",
        num_layers=2,
        num_kv_heads=2,
        head_dim=4,
        block_size=BLOCK,
        blocks_per_chunk=bpc,
    )
    fields.update(changes)
    return KVLayout(**fields)  # type: ignore[arg-type]


def config(
    lay: KVLayout, cpu_chunks: int, disk: str | None = None, disk_chunks: int = 0, policy: str = "lru"
) -> OffloadConfig:
    """A config whose CPU tier holds exactly ``cpu_chunks`` chunks (and the disk about ``disk_chunks``)."""
    tiers = [TierConfig(medium="cpu", size_bytes=cpu_chunks * lay.chunk_bytes)]
    if disk is not None:
        size = file_bytes(lay)
        tiers.append(TierConfig(medium="disk", size_bytes=disk_chunks * size + size // 2, path=disk))
    spec = "TieringOffloadingSpec" if disk else "CPUOffloadingSpec"
    return OffloadConfig(spec_name=spec, tiers=tiers, blocks_per_chunk=lay.blocks_per_chunk, eviction_policy=policy)


def file_bytes(lay: KVLayout) -> int:
    """The size of one chunk file of this layout (payload, header with hashes and tokens, digest)."""
    _, metas, data = sequence(lay, 1)
    return sum(memoryview(p).nbytes for p in encode_chunk(lay, metas[0], data[0]))


def sequence(lay: KVLayout, num_chunks: int, seed: int = 0) -> tuple[list[bytes], list[ChunkMeta], torch.Tensor]:
    """A sequence of ``num_chunks`` full chunks: its block hashes, the chunks' metas and data."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50_000, (num_chunks * lay.chunk_tokens,), generator=g).tolist()
    hashes = PrefixHasher(lay.block_size, lay.hash_algo).chain(tokens)
    bpc, n = lay.blocks_per_chunk, lay.chunk_tokens
    metas = [
        ChunkMeta(hashes[c * bpc : (c + 1) * bpc], hashes[c * bpc - 1] if c else None, tokens[c * n : (c + 1) * n])
        for c in range(num_chunks)
    ]
    data = torch.randn((num_chunks, *lay.chunk_shape), generator=g, dtype=lay.torch_dtype)
    return hashes, metas, data


@contextmanager
def tiny_tmpfs(size: str = "256k") -> Iterator[Path | None]:
    """A tmpfs of ``size`` mounted on a fresh directory, or None when this process may not mount."""
    mount = Path(tempfile.mkdtemp(prefix="sonar-tinyfs-"))
    try:
        mounted = (
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mount)],
                capture_output=True,
                text=True,
            ).returncode
            == 0
        )
    except FileNotFoundError:  # no mount(8)
        mounted = False
    if not mounted:
        mount.rmdir()
        yield None
        return
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)
        mount.rmdir()
