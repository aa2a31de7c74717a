"""Rotary position embedding applied in place to queries and keys from a cos/sin cache.

Reference: :func:`sonar.kernels.reference.rotary_embedding`. The cache is float32 ``[max_positions,
rot_dim]``, row ``p`` holding ``cos(p * inv_freq)`` then ``sin(p * inv_freq)`` (built by
:func:`sonar.kernels.reference.build_cos_sin_cache`; scaled frequencies such as Llama 3's, and
YaRN's attention factor, are baked into it). ``is_neox`` pairs dimension ``i`` with
``i + rot_dim / 2`` (Llama, Qwen, Mistral; Sonar's ``apply_rotary``), otherwise (gpt-j) ``2i``
with ``2i + 1``. Only the first ``rot_dim`` dimensions rotate. One program per token rotates all
its query and key heads, math in float32.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from sonar.kernels.triton._common import check_last_dim_contiguous, device_of, next_power_of_2


@triton.jit
def _rotate_heads(x_ptr, stride_t, stride_h, token, num_heads, cos, sin, half, IS_NEOX: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    idx = tl.arange(0, BLOCK_HALF)
    mask = (heads < num_heads)[:, None] & (idx < half)[None, :]
    base = x_ptr + token * stride_t + heads[:, None] * stride_h
    if IS_NEOX:
        first = base + idx[None, :]
        second = first + half
    else:
        first = base + 2 * idx[None, :]
        second = first + 1
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(second, mask=mask, other=0.0).to(tl.float32)
    out_ty = x_ptr.dtype.element_ty
    tl.store(first, (x1 * cos - x2 * sin).to(out_ty), mask=mask)
    tl.store(second, (x2 * cos + x1 * sin).to(out_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cache_ptr,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    cache_stride,
    num_heads,
    num_kv_heads,
    half,
    IS_NEOX: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    idx = tl.arange(0, BLOCK_HALF)
    row = cache_ptr + pos * cache_stride
    cos = tl.load(row + idx, mask=idx < half, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(row + half + idx, mask=idx < half, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr, q_stride_t, q_stride_h, token, num_heads, cos, sin, half, IS_NEOX, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr, k_stride_t, k_stride_h, token, num_kv_heads, cos, sin, half, IS_NEOX, BLOCK_HK, BLOCK_HALF)


def rotary_embedding(
    positions: Tensor, query: Tensor, key: Tensor, cos_sin_cache: Tensor, is_neox: bool = True
) -> tuple[Tensor, Tensor]:
    """Rotate ``query`` ``[num_tokens, num_heads, head_dim]`` and ``key`` ``[num_tokens,
    num_kv_heads, head_dim]`` in place (strided views, e.g. into a fused QKV output, are fine);
    returns them."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    rot_dim = cos_sin_cache.shape[-1]
    if key.shape[0] != num_tokens or key.shape[2] != head_dim or rot_dim > head_dim or rot_dim % 2:
        raise ValueError(f"query {tuple(query.shape)}, key {tuple(key.shape)}, cache {tuple(cos_sin_cache.shape)}")
    check_last_dim_contiguous(query, key, cos_sin_cache)
    if num_tokens:
        half = rot_dim // 2
        with device_of(query):
            _rotary_kernel[(num_tokens,)](
                positions,
                query,
                key,
                cos_sin_cache,
                query.stride(0),
                query.stride(1),
                key.stride(0),
                key.stride(1),
                cos_sin_cache.stride(0),
                num_heads,
                num_kv_heads,
                half,
                IS_NEOX=is_neox,
                BLOCK_HQ=next_power_of_2(num_heads),
                BLOCK_HK=next_power_of_2(num_kv_heads),
                BLOCK_HALF=next_power_of_2(half),
                num_warps=4,
            )
    return query, key
