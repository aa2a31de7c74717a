"""Moving KV between the primary cache and chunk tensors (the worker's side of a transfer).

The primary cache is one tensor per layer, ``[2, num_blocks, block_size, heads, dim]``. A chunk
is ``[num_layers, 2, blocks_per_chunk, block_size, heads, dim]`` (see ``layout.py``). Both
functions work on any device; with CUDA caches and a pinned CPU ``out`` the gather is one
device-to-host copy per layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["gather_chunks", "scatter_chunks"]


def _check_caches(kv_caches: Sequence[torch.Tensor]) -> None:
    if not kv_caches:
        raise ValueError("no KV cache tensors")
    shape = kv_caches[0].shape
    if len(shape) != 5 or shape[0] != 2:
        raise ValueError(f"a KV cache tensor must be [2, num_blocks, block_size, heads, dim], got {tuple(shape)}")
    for cache in kv_caches:
        if cache.shape != shape or cache.dtype != kv_caches[0].dtype:
            raise ValueError("all layers' KV cache tensors must share one shape and dtype")


def gather_chunks(
    kv_caches: Sequence[torch.Tensor],
    block_ids: Sequence[int],
    blocks_per_chunk: int,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Copy blocks out of the cache: ``[num_chunks, num_layers, 2, blocks_per_chunk, bs, heads, dim]``.

    ``block_ids`` lists the blocks of consecutive chunks, chunk after chunk (its length is a
    multiple of ``blocks_per_chunk``). ``out[i]`` is chunk ``i``, contiguous. The result never
    aliases the cache.
    """
    _check_caches(kv_caches)
    n = len(block_ids)
    if n == 0 or n % blocks_per_chunk:
        raise ValueError(f"{n} block ids do not make whole chunks of {blocks_per_chunk} blocks")
    num_chunks = n // blocks_per_chunk
    first = kv_caches[0]
    _, _, bs, heads, dim = first.shape
    shape = (num_chunks, len(kv_caches), 2, blocks_per_chunk, bs, heads, dim)
    if out is None:
        out = torch.empty(shape, dtype=first.dtype, device=first.device)
    elif tuple(out.shape) != shape or out.dtype != first.dtype:
        raise ValueError(f"out must be {shape} {first.dtype}, got {tuple(out.shape)} {out.dtype}")
    index = torch.as_tensor(list(block_ids), dtype=torch.long, device=first.device)
    for layer, cache in enumerate(kv_caches):
        # [2, n, bs, h, d] -> [2, chunks, bpc, bs, h, d] -> [chunks, 2, bpc, bs, h, d]
        blocks = cache.index_select(1, index).view(2, num_chunks, blocks_per_chunk, bs, heads, dim)
        out[:, layer].copy_(blocks.transpose(0, 1), non_blocking=True)
    return out


def scatter_chunks(
    kv_caches: Sequence[torch.Tensor],
    chunks: torch.Tensor | Sequence[torch.Tensor],
    block_ids: Sequence[int],
    *,
    skip_blocks: int = 0,
) -> None:
    """Write chunks back into the cache: the inverse of ``gather_chunks``.

    ``chunks`` is ``[num_chunks, num_layers, 2, bpc, bs, heads, dim]`` or a list of
    ``[num_layers, 2, bpc, bs, heads, dim]``. The blocks of the chunks, in order, after the first
    ``skip_blocks`` of them (already in the primary cache), go to ``block_ids``, one each; blocks of
    the last chunk beyond ``len(block_ids)`` are not written.
    """
    _check_caches(kv_caches)
    if not isinstance(chunks, torch.Tensor):
        chunks = torch.stack(list(chunks)) if len(chunks) else torch.empty(0)
    if chunks.dim() != 7 or chunks.shape[1] != len(kv_caches) or chunks.shape[2] != 2:
        raise ValueError(
            f"chunks must be [num_chunks, {len(kv_caches)}, 2, bpc, bs, heads, dim], got {tuple(chunks.shape)}"
        )
    first = kv_caches[0]
    num_chunks, _, _, bpc, bs, heads, dim = chunks.shape
    if (bs, heads, dim) != tuple(first.shape[2:]) or chunks.dtype != first.dtype:
        raise ValueError("the chunks' block shape or dtype differs from the cache's")
    n = len(block_ids)
    if skip_blocks < 0 or skip_blocks + n > num_chunks * bpc:
        raise ValueError(f"{num_chunks} chunks of {bpc} blocks cannot fill {n} blocks after skipping {skip_blocks}")
    if n == 0:
        return
    index = torch.as_tensor(list(block_ids), dtype=torch.long, device=first.device)
    for layer, cache in enumerate(kv_caches):
        # [chunks, 2, bpc, ...] -> [2, chunks * bpc, ...] -> the wanted run of blocks
        src = chunks[:, layer].transpose(0, 1).reshape(2, num_chunks * bpc, bs, heads, dim)
        src = src[:, skip_blocks : skip_blocks + n].to(first.device, non_blocking=True)
        cache.index_copy_(1, index, src)
