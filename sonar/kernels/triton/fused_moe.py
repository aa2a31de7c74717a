"""The fused MoE experts as grouped GEMMs over expert-sorted, block-padded token ids (the design
of vLLM's ``fused_moe_kernel``).

Reference: :func:`sonar.kernels.moe.fused_experts_reference`. The ``n * top_k`` (token, expert)
pairs are sorted by expert and each expert's run padded to a multiple of ``BLOCK_M``
(`align_block_size`, torch ops on the device, no host sync); every row block then belongs to one
expert, and one launch of `_moe_gemm_kernel` computes all experts' products at once:

1. ``gate_up[pair] = x[pair // top_k] @ w13[e].T`` (rows gathered from ``x`` by token);
2. ``act = silu_and_mul(gate_up)`` (`sonar.kernels.triton.silu_and_mul`; GPT-OSS: its clamped
   SwiGLU, `clamped_swiglu`, and each expert's biases added in the GEMMs' epilogues);
3. ``y[pair] = weight[pair] * act[pair] @ w2[e].T`` in float32, then each token's ``top_k``
   rows summed in float32 and rounded once.

Quantized experts (`sonar.models.moe.QuantizedExperts` on the CUDA backend) pass each projection
as `PackedExperts`, their `sonar.kernels.quant_triton` packings stacked: the same launches, each K
tile of the weight decoded from its packed values (`quant_matmul.load_values`: int4, int8, FP8,
MXFP4) and its group's scale (and offset) applied to the tile's sum, as `quant_matmul` does.

Pairs routed to expert -1 (an expert another expert-parallel rank holds) are left out of the
sort and add zero. Padding rows carry the id ``n * top_k`` and are neither read nor written; row
blocks past the padded total return at once (the grid is sized for the worst case, ``pairs + E * (BLOCK_M - 1)``
rows, so its size does not depend on the routing and a CUDA graph can capture it). Under the
interpreter the dots run in float32 (its bfloat16 arithmetic is wrong, see `_common`), as they do
for float32 inputs everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from sonar.kernels.triton._common import device_of, interpreting, next_power_of_2
from sonar.kernels.triton.quant_matmul import FORMAT_CODES, load_scales, load_values
from sonar.kernels.triton.silu_and_mul import silu_and_mul


@triton.jit
def _moe_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    weights_ptr,
    bias_ptr,
    scales_ptr,
    offsets_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    padded_total_ptr,
    N,
    K,
    num_pairs,
    a_stride,
    b_expert_stride,
    b_row_stride,
    c_stride,
    bias_stride,
    s_expert_stride,
    s_group_stride,
    group,
    TOP_K: tl.constexpr,
    A_BY_TOKEN: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FORMAT: tl.constexpr,
    HAS_OFFSETS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``c[pair, cols] = (weight[pair] *) (a[row(pair)] @ b[expert].T (+ bias[expert]))`` for one
    block of sorted pairs. ``FORMAT`` -1: ``b`` ``[E, N, K]`` in ``a``'s dtype (``b_row_stride``
    the stride of N); otherwise a `quant_matmul` code, ``b`` the experts' packed values ``[E, K or
    K / 2, N]`` (``b_row_stride`` the stride of K) with their scales (and offsets) ``[E, K / group,
    N]``, applied to each K tile's sum as `quant_matmul` does (``BLOCK_K`` divides ``group``)."""
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(padded_total_ptr):
        return
    expert = tl.load(expert_ids_ptr + block).to(tl.int64)
    pairs = tl.load(sorted_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    if A_BY_TOKEN:
        rows = pairs // TOP_K
    else:
        rows = pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    a_rows = a_ptr + rows[:, None].to(tl.int64) * a_stride
    b_expert = b_ptr + expert * b_expert_stride
    b_cols = b_expert + cols[None, :].to(tl.int64) * b_row_stride
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(a_rows + ks[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        if FORMAT < 0:
            b = tl.load(b_cols + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        else:
            b = load_values(b_expert, ks, cols, col_mask, b_row_stride, FORMAT)
        if DOT_FP32:
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, b.to(a.dtype))
        if FORMAT < 0:
            acc += part
        else:
            group_at = expert * s_expert_stride + (k0 // group) * s_group_stride
            acc += part * load_scales(scales_ptr + group_at, cols, col_mask, FORMAT)[None, :]
            if HAS_OFFSETS:
                o = tl.load(offsets_ptr + group_at + cols, mask=col_mask, other=0.0)
                acc += tl.sum(a.to(tl.float32), axis=1)[:, None] * o[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * bias_stride + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if MUL_WEIGHT:
        acc *= tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    c = c_ptr + pairs[:, None].to(tl.int64) * c_stride + cols[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & col_mask[None, :])


def align_block_size(ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor, Tensor]:
    """The pairs of ``ids`` ``[n, top_k]`` (pair ``p`` = token ``p // top_k``, slot ``p % top_k``)
    sorted by expert, each expert's run padded to a multiple of `block_m` with the id ``n * top_k``.
    Pairs of expert -1 (another expert-parallel rank's) are left out.

    Returns (sorted pair ids ``[pairs + E * (block_m - 1)]``, the expert of each row block,
    the padded total as a ``[1]`` tensor), all on ``ids``' device, without a host sync."""
    flat = ids.reshape(-1)
    pairs = flat.numel()
    device = flat.device
    # the left-out pairs go to an extra bucket E, sorted last and written to one dropped slot
    bucket = torch.where(flat >= 0, flat, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(bucket, stable=True)
    bucket_of_sorted = bucket[order]
    rank = torch.arange(pairs, device=device) - (counts.cumsum(0) - counts)[bucket_of_sorted]
    capacity = pairs + num_experts * (block_m - 1)
    starts = torch.cat([padded_end - padded, padded_end.new_full((1,), capacity)])
    slot = torch.where(bucket_of_sorted < num_experts, starts[bucket_of_sorted] + rank, capacity)
    sorted_ids = torch.full((capacity + 1,), pairs, dtype=torch.int64, device=device)
    sorted_ids[slot] = order
    sorted_ids = sorted_ids[:capacity]
    block_starts = torch.arange(0, capacity, block_m, device=device)
    expert_ids = torch.searchsorted(padded_end, block_starts, right=True).clamp_max(num_experts - 1)
    return sorted_ids, expert_ids, padded_end[-1:]


@dataclass(frozen=True)
class PackedExperts:
    """One projection of quantized experts as `_moe_gemm_kernel` reads it: each expert's
    `sonar.kernels.quant_triton.TritonBackend` packing, stacked (``values`` ``[E, K or K / 2, N]``,
    ``scales`` and ``offsets`` ``[E, K / group, N]``; MXFP4's scales its exponent bytes)."""

    format: str
    group: int
    in_features: int
    values: Tensor
    scales: Tensor
    offsets: Tensor | None


def _gemm(
    a: Tensor,
    b: Tensor | PackedExperts,
    c: Tensor,
    weights: Tensor,
    aligned: tuple[Tensor, Tensor, Tensor],
    top_k: int,
    a_by_token: bool,
    block_m: int,
    bias: Tensor | None = None,
) -> None:
    sorted_ids, expert_ids, padded_total = aligned
    if isinstance(b, PackedExperts):
        n_out, k = b.values.shape[2], b.in_features
        # a K tile never straddles two groups of scales
        block_k = math.gcd(b.group, 64)
        values, scales, offsets, fmt = b.values, b.scales, b.offsets, FORMAT_CODES[b.format]
        b_row_stride, s_strides, group = values.stride(1), (scales.stride(0), scales.stride(1)), b.group
    else:
        n_out, k = b.shape[1], b.shape[2]
        block_k = min(max(next_power_of_2(k), 16), 64)
        values, scales, offsets, fmt = b, weights, None, -1
        b_row_stride, s_strides, group = b.stride(1), (0, 0), 1
    block_n = min(max(next_power_of_2(n_out), 16), 64)
    grid = (triton.cdiv(sorted_ids.numel(), block_m), triton.cdiv(n_out, block_n))
    with device_of(a):
        _moe_gemm_kernel[grid](
            a,
            values,
            c,
            weights,
            weights if bias is None else bias,
            scales,
            scales if offsets is None else offsets,
            sorted_ids,
            expert_ids,
            padded_total,
            n_out,
            k,
            weights.numel(),
            a.stride(0),
            values.stride(0),
            b_row_stride,
            c.stride(0),
            0 if bias is None else bias.stride(0),
            *s_strides,
            group,
            TOP_K=top_k,
            A_BY_TOKEN=a_by_token,
            MUL_WEIGHT=not a_by_token,
            HAS_BIAS=bias is not None,
            FORMAT=fmt,
            HAS_OFFSETS=offsets is not None,
            DOT_FP32=interpreting() or a.dtype == torch.float32,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
        )


@triton.jit
def _clamped_swiglu_kernel(x_ptr, out_ptr, x_stride, out_stride, d, limit, alpha, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + d + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    y = (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def clamped_swiglu(x: Tensor, limit: float, alpha: float) -> Tensor:
    """`sonar.kernels.reference.clamped_swiglu` of ``x`` ``[rows, 2 d]`` (contiguous), computed
    in float32 and rounded once."""
    rows, two_d = x.shape
    d = two_d // 2
    out = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    if rows and d:
        block = min(next_power_of_2(d), 1024)
        with device_of(x):
            _clamped_swiglu_kernel[(rows, triton.cdiv(d, block))](
                x, out, x.stride(0), out.stride(0), d, float(limit), float(alpha), BLOCK=block, num_warps=4
            )
    return out


def fused_experts(
    x: Tensor,
    weights: Tensor,
    ids: Tensor,
    w13: Tensor | PackedExperts,
    w2: Tensor | PackedExperts,
    b13: Tensor | None = None,
    b2: Tensor | None = None,
    swiglu_limit: float | None = None,
    swiglu_alpha: float = 1.702,
) -> Tensor:
    """``x`` ``[n, h]``, routing ``weights``/``ids`` ``[n, top_k]``, ``w13`` ``[E, 2 I, h]``,
    ``w2`` ``[E, h, I]`` (contiguous, ``x``'s dtype; or both quantized, `PackedExperts`) ->
    ``[n, h]``; the biases ``b13`` ``[E, 2 I]`` / ``b2`` ``[E, h]`` are added in the GEMMs'
    float32 epilogue (``b2`` before the routing weight), and a `swiglu_limit` selects GPT-OSS's
    clamped SwiGLU for silu-and-mul."""
    n, h = x.shape
    top_k = ids.shape[1]
    if isinstance(w13, PackedExperts):
        experts, two_i = w13.values.shape[0], w13.values.shape[2]
    else:
        experts, two_i, _ = w13.shape
    if n == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    weights = weights.to(torch.float32).contiguous()
    # about one row block per expert or less (decode): small blocks, less padding computed for nothing
    block_m = 16 if n * top_k <= 16 * experts else 64
    aligned = align_block_size(ids.to(torch.int64), experts, block_m)
    pairs = n * top_k
    # zeros: the left-out pairs' rows (expert -1) are never written, and their activation is computed
    gate_up = torch.zeros(pairs, two_i, dtype=x.dtype, device=x.device)
    _gemm(x, w13, gate_up, weights, aligned, top_k, True, block_m, b13)
    act = silu_and_mul(gate_up) if swiglu_limit is None else clamped_swiglu(gate_up, swiglu_limit, swiglu_alpha)
    # zeros: the rows of left-out pairs (expert -1) are never written and must add nothing
    y = torch.zeros(pairs, h, dtype=torch.float32, device=x.device)
    _gemm(act, w2, y, weights, aligned, top_k, False, block_m, b2)
    return y.view(n, top_k, h).sum(dim=1).to(x.dtype)
