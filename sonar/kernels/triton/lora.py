"""The batched LoRA add: each row of a flat batch gets the delta of its own adapter slot.

Reference: :func:`sonar.kernels.reference.lora_add` (the shrink accumulated in float32 and rounded
to the adapters' dtype, the expand accumulated in float32, ``y + delta`` rounded once). Two
gather-style kernels, whatever the mix of slots: no host sync, no per-adapter launch, so a CUDA
graph captures them with the rows' slots as data.

- shrink, grid ``(rows, cdiv(J R, BLOCK_R))``: ``t[i] = A[rows[i]] @ x[i]`` for all ``J``
  sub-projections at once (A's rows of a slot are contiguous);
- expand, grid ``(rows, J, cdiv(max(splits), BLOCK_N))``: ``y[i, cols] += B[rows[i], cols] @ t[i, j]``
  over one block of sub-projection ``j``'s columns.

Rows of slot -1 return at once. The sub-projections' sizes are scalar arguments (up to
`LORA_MAX_SPLITS`, the fused ``qkv_proj`` has three) rather than a device table, so a call needs
no host-to-device copy. Loads are converted to float32 before arithmetic (the interpreter's
bfloat16, see `_common`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sonar.kernels.triton._common import check_last_dim_contiguous, device_of, next_power_of_2

LORA_MAX_SPLITS = 4


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    t_ptr,
    rows_ptr,
    x_stride,
    a_slot_stride,
    a_row_stride,
    t_stride,
    in_features,
    shrunk,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(rows_ptr + row)
    if slot < 0:
        return
    rs = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = rs < shrunk
    a_rows = a_ptr + slot * a_slot_stride + rs[:, None].to(tl.int64) * a_row_stride
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < in_features
        xv = tl.load(x_ptr + row * x_stride + ks, mask=k_mask, other=0.0).to(tl.float32)
        av = tl.load(a_rows + ks[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(av * xv[None, :], axis=1)
    tl.store(t_ptr + row * t_stride + rs, acc.to(t_ptr.dtype.element_ty), mask=r_mask)


@triton.jit
def _lora_expand_kernel(
    y_ptr,
    t_ptr,
    b_ptr,
    rows_ptr,
    y_stride,
    t_stride,
    b_slot_stride,
    b_row_stride,
    rank,
    size0,
    size1,
    size2,
    size3,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    slot = tl.load(rows_ptr + row)
    if slot < 0:
        return
    start = tl.where(j > 0, size0, 0) + tl.where(j > 1, size1, 0) + tl.where(j > 2, size2, 0)
    size = tl.where(j == 0, size0, tl.where(j == 1, size1, tl.where(j == 2, size2, size3)))
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    c_mask = cols < size
    b_rows = b_ptr + slot * b_slot_stride + (start + cols[:, None]).to(tl.int64) * b_row_stride
    t_row = t_ptr + row * t_stride + j * rank
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        rs = r0 + tl.arange(0, BLOCK_R)
        r_mask = rs < rank
        tv = tl.load(t_row + rs, mask=r_mask, other=0.0).to(tl.float32)
        bv = tl.load(b_rows + rs[None, :], mask=c_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(bv * tv[None, :], axis=1)
    y_cols = y_ptr + row * y_stride + start + cols
    yv = tl.load(y_cols, mask=c_mask, other=0.0).to(tl.float32)
    tl.store(y_cols, (yv + acc).to(y_ptr.dtype.element_ty), mask=c_mask)


def lora_add(y: Tensor, x: Tensor, a: Tensor, b: Tensor, rows: Tensor, splits: tuple[int, ...]) -> None:
    """``y`` ``[n, sum(splits)]`` += each row's adapter delta, in place; ``x`` ``[n, in]``, ``a``
    ``[S, J R, in]``, ``b`` ``[S, sum(splits), R]``, ``rows`` int64 ``[n]`` (-1: no adapter), one
    dtype for ``x``, ``y``, ``a`` and ``b``; at most `LORA_MAX_SPLITS` sub-projections."""
    parts = len(splits)
    if not 0 < parts <= LORA_MAX_SPLITS:
        raise ValueError(f"1 to {LORA_MAX_SPLITS} sub-projections, got {parts}")
    n, in_features = x.shape
    shrunk = a.shape[1]
    rank = shrunk // parts
    if y.shape != (n, sum(splits)) or a.shape[2] != in_features or shrunk != parts * rank:
        raise ValueError(f"shapes do not fit: y {tuple(y.shape)}, x {tuple(x.shape)}, a {tuple(a.shape)}")
    if b.shape != (a.shape[0], sum(splits), rank) or rows.shape != (n,):
        raise ValueError(f"shapes do not fit: b {tuple(b.shape)}, rows {tuple(rows.shape)}, splits {splits}")
    check_last_dim_contiguous(y, x, a, b)
    if n == 0:
        return
    t = torch.empty(n, shrunk, dtype=a.dtype, device=x.device)
    block_r = min(next_power_of_2(shrunk), 64)
    block_k = min(next_power_of_2(in_features), max(4096 // block_r, 16))
    block_n = min(next_power_of_2(max(splits)), 64)
    block_rank = min(next_power_of_2(rank), max(4096 // block_n, 16))
    sizes = (*splits, *(0,) * (LORA_MAX_SPLITS - parts))
    with device_of(x):
        _lora_shrink_kernel[(n, triton.cdiv(shrunk, block_r))](
            x,
            a,
            t,
            rows,
            x.stride(0),
            a.stride(0),
            a.stride(1),
            t.stride(0),
            in_features,
            shrunk,
            BLOCK_R=block_r,
            BLOCK_K=block_k,
        )
        _lora_expand_kernel[(n, parts, triton.cdiv(max(splits), block_n))](
            y,
            t,
            b,
            rows,
            y.stride(0),
            t.stride(0),
            b.stride(0),
            b.stride(1),
            rank,
            *sizes,
            BLOCK_N=block_n,
            BLOCK_R=block_rank,
        )
