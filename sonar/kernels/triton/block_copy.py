"""Block copy between KV cache tensors (e.g. a GPU cache and an offload tier's staging tensor).

Reference: :func:`sonar.kernels.reference.copy_blocks`. Caches are laid out ``[2, num_blocks,
block_size, num_kv_heads, head_dim]`` (``sonar.kernels.attention``); both must have the same
block shape and dtype and contiguous blocks, and both must be reachable by the kernel (on one
GPU; :func:`sonar.kernels.ops.copy_blocks` takes the torch path between devices). Grid
``(num_pairs, 2, cdiv(block_numel, BLOCK))``: each program copies a chunk of the K or V half of
one block, as raw elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sonar.kernels.triton._common import device_of, next_power_of_2


@triton.jit
def _copy_blocks_kernel(
    src_ptr,
    dst_ptr,
    src_ids_ptr,
    dst_ids_ptr,
    src_stride_kv,
    src_stride_block,
    dst_stride_kv,
    dst_stride_block,
    block_numel,
    BLOCK: tl.constexpr,
):
    pair = tl.program_id(0)
    kv = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    src_block = tl.load(src_ids_ptr + pair).to(tl.int64)
    dst_block = tl.load(dst_ids_ptr + pair).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_numel
    x = tl.load(src_ptr + kv * src_stride_kv + src_block * src_stride_block + offs, mask=mask)
    tl.store(dst_ptr + kv * dst_stride_kv + dst_block * dst_stride_block + offs, x, mask=mask)


def _check_blocks_contiguous(t: Tensor) -> None:
    expected = 1
    for size, stride in reversed(list(zip(t.shape[2:], t.stride()[2:]))):
        if size != 1 and stride != expected:
            raise ValueError(f"blocks must be contiguous, got strides {t.stride()}")
        expected *= size


def copy_blocks(src: Tensor, dst: Tensor, src_block_ids: Tensor, dst_block_ids: Tensor) -> None:
    """Copy ``src[:, src_block_ids[i]]`` to ``dst[:, dst_block_ids[i]]`` for every ``i`` (int32 or
    int64 id tensors on the caches' device)."""
    if src.shape[0] != 2 or src.shape[2:] != dst.shape[2:] or src.dtype != dst.dtype:
        raise ValueError(
            f"block shapes/dtypes differ: {tuple(src.shape)} {src.dtype} vs {tuple(dst.shape)} {dst.dtype}"
        )
    if src_block_ids.shape != dst_block_ids.shape or src_block_ids.dim() != 1:
        raise ValueError("src_block_ids and dst_block_ids must be 1-D and of one length")
    _check_blocks_contiguous(src)
    _check_blocks_contiguous(dst)
    pairs = src_block_ids.shape[0]
    block_numel = src[0, 0].numel()
    if pairs == 0 or block_numel == 0:
        return
    # copy raw bits: integer views of the same width (no float8 type needed on the GPU)
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[src.element_size()]
    src, dst = src.view(as_int), dst.view(as_int)
    block = min(next_power_of_2(block_numel), 4096)
    with device_of(src):
        _copy_blocks_kernel[(pairs, 2, triton.cdiv(block_numel, block))](
            src,
            dst,
            src_block_ids,
            dst_block_ids,
            src.stride(0),
            src.stride(1),
            dst.stride(0),
            dst.stride(1),
            block_numel,
            BLOCK=block,
            num_warps=4,
        )
