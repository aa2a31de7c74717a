"""KV cache write ("reshape and cache"): store each new token's key and value rows at its slot.

Reference: :func:`sonar.kernels.reference.write_kv_cache` (layout in :mod:`sonar.kernels.attention`:
cache ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, slot = block * block_size + offset).
One program per token writes all its KV heads. A negative slot is a padding token and is skipped.
A float8 e4m3 cache gets ``x / scale`` rounded to nearest-even and saturated at +-448, with a
per-tensor (``[1]``) or per-head (``[num_kv_heads]``) float32 scale for keys and for values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sonar.kernels.triton._common import (
    check_fp8_supported,
    check_last_dim_contiguous,
    device_of,
    next_power_of_2,
    round_to_e4m3,
)


@triton.jit
def _load_scale(scale_ptr, heads, head_mask, PER_HEAD: tl.constexpr):
    if PER_HEAD:
        return tl.load(scale_ptr + heads, mask=head_mask, other=1.0)[:, None]
    else:
        return tl.load(scale_ptr)


@triton.jit
def _kv_cache_write_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    key_stride_t,
    key_stride_h,
    value_stride_t,
    value_stride_h,
    cache_stride_kv,
    cache_stride_block,
    cache_stride_tok,
    cache_stride_head,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,
    SCALE_PER_HEAD: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_mask = heads < num_kv_heads
    mask = head_mask[:, None] & (dims < head_dim)[None, :] & (slot >= 0)
    slot = tl.maximum(slot, 0)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    row = t.to(tl.int64)
    k = tl.load(key_ptr + row * key_stride_t + heads[:, None] * key_stride_h + dims[None, :], mask=mask)
    v = tl.load(value_ptr + row * value_stride_t + heads[:, None] * value_stride_h + dims[None, :], mask=mask)
    dst = cache_ptr + block * cache_stride_block + offset * cache_stride_tok + heads[:, None] * cache_stride_head
    dst = dst + dims[None, :]
    out_ty = cache_ptr.dtype.element_ty
    if QUANT:
        k_scale = _load_scale(k_scale_ptr, heads, head_mask, SCALE_PER_HEAD)
        v_scale = _load_scale(v_scale_ptr, heads, head_mask, SCALE_PER_HEAD)
        kq = round_to_e4m3(k.to(tl.float32) / k_scale)
        vq = round_to_e4m3(v.to(tl.float32) / v_scale)
        tl.store(dst, kq.to(out_ty), mask=mask)
        tl.store(dst + cache_stride_kv, vq.to(out_ty), mask=mask)
    else:
        tl.store(dst, k.to(tl.float32).to(out_ty), mask=mask)
        tl.store(dst + cache_stride_kv, v.to(tl.float32).to(out_ty), mask=mask)


def write_kv_cache(
    key: Tensor,
    value: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> None:
    """Store ``key`` / ``value`` ``[num_tokens, num_kv_heads, head_dim]`` (rows may be strided,
    e.g. views into a fused QKV output) at ``slot_mapping`` of ``kv_cache``, in place."""
    num_tokens, num_kv_heads, head_dim = key.shape
    _, _, block_size, cache_heads, cache_dim = kv_cache.shape
    if (cache_heads, cache_dim) != (num_kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(
            f"key {tuple(key.shape)} / value {tuple(value.shape)} do not fit cache {tuple(kv_cache.shape)}"
        )
    check_last_dim_contiguous(key, value, kv_cache)
    quant = kv_cache.dtype == torch.float8_e4m3fn
    if quant and (k_scale is None or v_scale is None):
        raise ValueError("an fp8 KV cache needs k_scale and v_scale")
    if quant:
        check_fp8_supported(kv_cache)
    per_head = quant and k_scale.numel() > 1
    if quant and (k_scale.numel() not in (1, num_kv_heads) or v_scale.numel() != k_scale.numel()):
        raise ValueError("k_scale / v_scale must have 1 or num_kv_heads elements each")
    if num_tokens == 0:
        return
    k_scale_arg = k_scale if quant else slot_mapping  # unused pointer when not quantizing
    v_scale_arg = v_scale if quant else slot_mapping
    with device_of(kv_cache):
        _kv_cache_write_kernel[(num_tokens,)](
            key,
            value,
            kv_cache,
            slot_mapping,
            k_scale_arg,
            v_scale_arg,
            key.stride(0),
            key.stride(1),
            value.stride(0),
            value.stride(1),
            kv_cache.stride(0),
            kv_cache.stride(1),
            kv_cache.stride(2),
            kv_cache.stride(3),
            num_kv_heads,
            head_dim,
            BLOCK_SIZE=block_size,
            BLOCK_H=next_power_of_2(num_kv_heads),
            BLOCK_D=next_power_of_2(head_dim),
            QUANT=quant,
            SCALE_PER_HEAD=per_head,
            num_warps=4,
        )
