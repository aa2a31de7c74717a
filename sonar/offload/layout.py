"""What an offloaded chunk is: its tensor shape and the identity that makes it reusable.

A chunk holds ``blocks_per_chunk`` consecutive primary KV blocks of one sequence, every layer,
keys and values, as one contiguous tensor of shape

    [num_layers, 2, blocks_per_chunk, block_size, num_kv_heads, head_dim]

(``2``: keys, then values; the inner ``[block_size, num_kv_heads, head_dim]`` is exactly one
block of one layer's cache as ``sonar.kernels.attention`` lays it out). Chunks are aligned to the
start of the sequence: chunk ``c`` covers blocks ``c * blocks_per_chunk .. (c + 1) *
blocks_per_chunk - 1``.

``KVLayout`` is the identity a stored chunk carries: KV computed by another model, dtype, block
layout, hash algorithm or format version must never be served, even when a block hash collides
(the hashes cover token ids only).
"""

from __future__ import annotations

import msgspec
import torch

__all__ = ["KV_FORMAT_VERSION", "KVLayout"]

KV_FORMAT_VERSION = 1
"""Bump when the chunk layout or the disk file format changes: older files become foreign."""

LAYOUT_NAME = "layer,kv,block,token,head,dim"


class KVLayout(msgspec.Struct, frozen=True, kw_only=True):
    """The identity and shape of the chunks one engine stores."""

    model: str
    dtype: str
    """torch dtype name without the ``torch.`` prefix (``bfloat16``, ``float32``, ...)."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    """Tokens per primary KV block."""
    blocks_per_chunk: int = 1
    hash_algo: str = "sha256"
    """The prefix-cache hash algorithm: chunk keys are its block hashes."""
    layout: str = LAYOUT_NAME
    format_version: int = KV_FORMAT_VERSION

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "blocks_per_chunk"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive, got {getattr(self, name)}")
        self.torch_dtype  # raises on an unknown dtype name

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"KVLayout.dtype: unknown torch dtype {self.dtype!r}")
        return dtype

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.blocks_per_chunk, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def chunk_tokens(self) -> int:
        return self.blocks_per_chunk * self.block_size

    @property
    def chunk_bytes(self) -> int:
        n = 1
        for d in self.chunk_shape:
            n *= d
        return n * torch.empty((), dtype=self.torch_dtype).element_size()

    def identity(self) -> dict[str, object]:
        """The fields a stored chunk must match to be served (all of them)."""
        return msgspec.to_builtins(self)

    @classmethod
    def for_caches(
        cls, kv_caches: list[torch.Tensor], *, model: str, blocks_per_chunk: int = 1, hash_algo: str = "sha256"
    ) -> "KVLayout":
        """The layout of chunks cut from per-layer caches ``[2, num_blocks, block_size, heads, dim]``."""
        _, _, block_size, heads, dim = kv_caches[0].shape
        return cls(
            model=model,
            dtype=str(kv_caches[0].dtype).removeprefix("torch."),
            num_layers=len(kv_caches),
            num_kv_heads=heads,
            head_dim=dim,
            block_size=block_size,
            blocks_per_chunk=blocks_per_chunk,
            hash_algo=hash_algo,
        )
