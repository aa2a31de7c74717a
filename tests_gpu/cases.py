"""Shapes and batch builders shared by the GPU tests and the kernel benchmark."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sonar.kernels import reference
from sonar.kernels.attention import AttentionMetadata


@dataclass(frozen=True)
class AttnShape:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int


LLAMA_8B = AttnShape("llama-3-8b", 32, 8, 128)
QWEN3_06B = AttnShape("qwen3-0.6b", 16, 8, 128)
SMOLLM2_135M = AttnShape("smollm2-135m", 9, 3, 64)
BLOCK_SIZE = 16


@dataclass
class PagedBatch:
    query: torch.Tensor
    cache: torch.Tensor
    meta: AttentionMetadata
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None

    @property
    def scale(self) -> float:
        return self.query.shape[-1] ** -0.5


def paged_batch(
    shape: AttnShape,
    query_lens: list[int],
    seq_lens: list[int],
    dtype: torch.dtype = torch.bfloat16,
    kv_dtype: torch.dtype | None = None,
    per_head_scale: bool = False,
    spare_blocks: int = 64,
    poison: bool = True,
    device: str = "cuda",
) -> PagedBatch:
    """Every sequence's context in scattered blocks of one cache (other slots NaN when
    ``poison``), written by the reference write, plus the step's queries."""
    kv_dtype = kv_dtype or dtype
    need = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks).tolist()
    tables, taken = [], 0
    for n in need:
        tables.append(perm[taken : taken + n])
        taken += n
    fill = float("nan") if poison else 0.0
    cache = torch.full(
        (2, num_blocks, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim), fill, dtype=torch.float32, device=device
    ).to(kv_dtype)
    full = AttentionMetadata.build(seq_lens, seq_lens, tables, BLOCK_SIZE, device=device)
    total = sum(seq_lens)
    key = torch.randn(total, shape.num_kv_heads, shape.head_dim, device=device, dtype=dtype)
    value = torch.randn(total, shape.num_kv_heads, shape.head_dim, device=device, dtype=dtype)
    k_scale = v_scale = None
    if kv_dtype == torch.float8_e4m3fn:
        k_scale, v_scale = reference.kv_scales(key, value, per_head=per_head_scale)
    reference.write_kv_cache(key, value, cache, full.slot_mapping, k_scale, v_scale)
    del key, value
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE, device=device)
    query = torch.randn(sum(query_lens), shape.num_heads, shape.head_dim, device=device, dtype=dtype)
    return PagedBatch(query, cache, meta, k_scale, v_scale)


def reference_attention(batch: PagedBatch, window: int | None = None) -> torch.Tensor:
    """The torch reference in float32 (the exact side of the comparison)."""
    cache = batch.cache
    if cache.dtype == torch.float8_e4m3fn:
        cache = reference.dequantize_kv_cache(cache, batch.k_scale, batch.v_scale, torch.float32)
    return reference.paged_attention(batch.query.float(), cache.float(), batch.meta, batch.scale, window)
