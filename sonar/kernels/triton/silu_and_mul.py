"""SiLU-and-mul, the gated MLP's activation: ``silu(x[..., :d]) * x[..., d:]``.

Reference: :func:`sonar.kernels.reference.silu_and_mul` (computed in float32, rounded once to the
input dtype). Grid ``(num_rows, cdiv(d, BLOCK))``; it reads the fused gate/up projection once and
writes half as much.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sonar.kernels.triton._common import device_of, next_power_of_2


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + d + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: Tensor, out: Tensor | None = None) -> Tensor:
    """``x`` ``[..., 2 * d]`` -> ``[..., d]``."""
    two_d = x.shape[-1]
    if two_d % 2:
        raise ValueError(f"the last dimension must be even, got {two_d}")
    d = two_d // 2
    x2 = x.reshape(-1, two_d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, d)
    rows = x2.shape[0]
    if rows and d:
        block = min(next_power_of_2(d), 1024)
        with device_of(x):
            _silu_and_mul_kernel[(rows, triton.cdiv(d, block))](
                x2, out2, x2.stride(0), out2.stride(0), d, BLOCK=block, num_warps=4
            )
    return out
