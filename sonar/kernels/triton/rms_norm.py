"""RMSNorm over the last dimension, optionally fused with the residual add before it.

Reference: :func:`sonar.kernels.reference.rms_norm` (as ``sonar.models.decoder.RMSNorm``: float32
statistics, the normalized row cast back to the input dtype before the weight multiplies). With a
residual the kernel computes ``residual = x + residual`` (rounded to the input dtype), writes it
back into ``residual`` and normalizes it, which saves the separate add's read and write. One
program per row; the whole row is one tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sonar.kernels.triton._common import device_of, next_power_of_2


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    x_stride,
    residual_stride,
    out_stride,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + r).to(dtype)
        tl.store(residual_ptr + row * residual_stride + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    mean_square = tl.sum(x * x, 0) / hidden
    h = (x * tl.math.rsqrt(mean_square + eps)).to(dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (h * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None, out: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    """Normalize ``x`` ``[..., hidden]``. Without ``residual`` returns the normed tensor; with it
    (same shape as ``x``, updated in place to ``x + residual``) returns ``(normed, residual)``.
    ``out`` may be ``x`` itself."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight {tuple(weight.shape)} does not fit hidden size {hidden}")
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty_like(x)
    out2 = out.view(-1, hidden)
    res2 = None
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
        res2 = residual.view(-1, hidden)  # a view: the update must land in the caller's tensor
        if res2.stride(-1) != 1:
            raise ValueError("residual's last dimension must be contiguous")
    rows = x2.shape[0]
    if rows:
        block = next_power_of_2(hidden)
        with device_of(x):
            _rms_norm_kernel[(rows,)](
                x2,
                res2 if res2 is not None else x2,
                weight,
                out2,
                x2.stride(0),
                res2.stride(0) if res2 is not None else 0,
                out2.stride(0),
                hidden,
                eps,
                HAS_RESIDUAL=res2 is not None,
                BLOCK=block,
                num_warps=min(max(block // 256, 1), 16),
            )
    return out if residual is None else (out, residual)
