"""Weight-only quantized GEMM (W4A16, W8A16, FP8 weights) with dequantization in the K loop, and
the per-token FP8 quantization of activations that ``torch._scaled_mm`` takes.

Reference: :func:`sonar.kernels.quant.reference_linear` over the logical layout of
:mod:`sonar.kernels.quant`. The kernel reads the layout as :class:`sonar.kernels.quant_triton.TritonBackend`
packs it, transposed so that a tile's loads run along N:

- values ``[K, N]`` (int8; FP8 as its uint8 bits) or, for int4 and MXFP4's E2M1 codes,
  ``[K // 2, N]`` uint8 with input column ``2j`` in the low nibble of byte row ``j`` and ``2j + 1``
  in the high one;
- scales and offsets ``[K // group, N]`` float32; MXFP4's scales as their E8M0 exponent bytes
  (uint8, the scale 2^(e - 128)), decoded from their bits like the FP8 values.

Every value is exact in the activations' dtype (0..15, -128..127, every e4m3 number and every
doubled E2M1 value of `sonar.kernels.quant.MXFP4_VALUES` are bf16 and fp16 numbers), so the dot of a K tile multiplies exact operands into a float32 accumulator and
the group's scale and offset apply to the tile's sum: ``sum_k x_k (v_k s + o) = s * (x . v) + o *
sum_k x_k``. Nothing is rounded to bf16 on the weight side, which keeps the kernel as close to the
float32 reference as float32 summation order allows. A K tile never straddles two groups
(``BLOCK_K`` divides the group), hence groups must be multiples of 16 (``tl.dot``'s smallest K).

FP8 weights are decoded from their bits with integer arithmetic rather than Triton's float8
type, which needs compute capability 8.9: this is the fallback for GPUs that cannot run FP8
matmuls (and for group-wise FP8 scales anywhere). The e4m3fn NaN pattern decodes to 480; a
weight is never NaN.

Small M (decode) leaves most SMs idle with one program per output tile, so K is split across
programs whose float32 partial sums a second kernel adds (with the bias), deterministically.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from sonar.kernels.triton._common import device_of, interpreting, round_to_e4m3

#: ``FORMAT`` constexpr codes of the kernel.
FORMAT_CODES = {"int4": 4, "int8": 8, "fp8": 0, "mxfp4": 1}


@triton.jit
def load_values(w_ptr, offs_k, offs_n, n_mask, stride_wk, FORMAT: tl.constexpr):
    """The ``[BLOCK_K, BLOCK_N]`` tile of weight values as float32 (exact)."""
    if FORMAT == 4 or FORMAT == 1:
        # both columns of a byte load the same address; the second load hits the cache
        b = tl.load(w_ptr + (offs_k[:, None] // 2) * stride_wk + offs_n[None, :], mask=n_mask[None, :], other=0)
        code = (b.to(tl.int32) >> ((offs_k[:, None] % 2) * 4)) & 0xF
        if FORMAT == 4:
            v = code.to(tl.float32)
        else:
            # doubled E2M1: magnitude codes 0 and 1 are 0 and 1, code m >= 2 is 2^(m >> 1) (1 + (m & 1) / 2),
            # whose float32 bits are the code shifted under a biased exponent, as for FP8 below
            magnitude = code & 7
            normal = ((magnitude << 22) + (127 << 23)).to(tl.float32, bitcast=True)
            v = tl.where(magnitude < 2, magnitude.to(tl.float32), normal)
            v = tl.where((code & 8) != 0, -v, v)
    elif FORMAT == 8:
        v = tl.load(w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :], mask=n_mask[None, :], other=0)
        v = v.to(tl.float32)
    else:
        bits = tl.load(w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :], mask=n_mask[None, :], other=0)
        bits = bits.to(tl.int32)
        magnitude = bits & 0x7F
        # e4m3 exponent bias 7, float32's 127: shifting the 7 magnitude bits into place and adding
        # 120 to the exponent gives every normal number; subnormals are multiples of 2**-9
        normal = ((magnitude << 20) + (120 << 23)).to(tl.float32, bitcast=True)
        subnormal = (magnitude & 7).to(tl.float32) * 0.001953125
        v = tl.where(magnitude < 8, subnormal, normal)
        v = tl.where((bits & 0x80) != 0, -v, v)
    return v


@triton.jit
def load_scales(scales_ptr, offs_n, n_mask, FORMAT: tl.constexpr):
    """One group's ``[BLOCK_N]`` scales as float32: MXFP4's exponent byte e is 2^(e - 128), float32
    bits ``(e - 1) << 23`` (e = 0 and 1 the subnormals 2^-128 and 2^-127, bits ``1 << (21 + e)``)."""
    if FORMAT == 1:
        e = tl.load(scales_ptr + offs_n, mask=n_mask, other=0).to(tl.int32)
        s = tl.where(e > 1, (e - 1) << 23, 1 << (21 + e)).to(tl.float32, bitcast=True)
    else:
        s = tl.load(scales_ptr + offs_n, mask=n_mask, other=0.0)
    return s


@triton.jit
def _quant_matmul_kernel(
    x_ptr,
    w_ptr,
    scales_ptr,
    offsets_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    stride_xm,
    stride_wk,
    stride_sg,
    stride_om,
    stride_os,
    group,
    k_per_split,
    FORMAT: tl.constexpr,
    HAS_OFFSETS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = pid_s * k_per_split
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None], other=0.0)
        v = load_values(w_ptr, offs_k, offs_n, n_mask, stride_wk, FORMAT)
        if DOT_FP32:
            part = tl.dot(x.to(tl.float32), v, input_precision="ieee")
        else:
            part = tl.dot(x, v.to(x.dtype))
        g = k0 // group
        s = load_scales(scales_ptr + g * stride_sg, offs_n, n_mask, FORMAT)
        acc += part * s[None, :]
        if HAS_OFFSETS:
            o = tl.load(offsets_ptr + g * stride_sg + offs_n, mask=n_mask, other=0.0)
            acc += tl.sum(x.to(tl.float32), axis=1)[:, None] * o[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT:
        out = out_ptr + pid_s * stride_os + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _sum_splits_kernel(
    part_ptr, bias_ptr, out_ptr, numel, N, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(part_ptr + s * numel + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs are enough to exercise the split
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_tiles(m: int, n: int, k: int, group: int, device: torch.device) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, splits)`` for an ``[m, k] x [k, n]`` product: tiles sized to M
    (decode is one row), BLOCK_K the largest power of two up to 128 (64 past decode) that divides
    the group, and K split until the grid covers the SMs about twice."""
    if m <= 16:
        block_m, block_n, pref_k = 16, 32, 128
    elif m <= 64:
        block_m, block_n, pref_k = 32 if m <= 32 else 64, 64, 64
    else:
        block_m, block_n, pref_k = 64, 128, 64
    block_k = math.gcd(group, pref_k)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_blocks = k // block_k
    splits = 1
    target = 2 * _num_sms(device)
    while tiles * splits < target and k_blocks % (2 * splits) == 0 and k_blocks // (2 * splits) >= 2:
        splits *= 2
    return block_m, block_n, block_k, splits


def check_group(group: int, in_features: int) -> bool:
    """Whether the kernel serves this group size: a multiple of 16 that divides K."""
    return group % 16 == 0 and in_features % group == 0


def quant_matmul(
    x: Tensor,
    weight: Tensor,
    scales: Tensor,
    offsets: Tensor | None,
    fmt: str,
    group: int,
    bias: Tensor | None = None,
    splits: int | None = None,
) -> Tensor:
    """``x [M, K] @ w.T + bias`` in ``x``'s dtype for a weight packed as the module doc says
    (`scales`: MXFP4's exponent bytes).
    ``splits`` fixes the number of K splits (None: `choose_tiles`'s)."""
    m, k = x.shape
    n = weight.shape[1]
    if fmt not in FORMAT_CODES:
        raise ValueError(f"unknown format {fmt!r}")
    if not check_group(group, k):
        raise ValueError(f"group {group} must be a multiple of 16 dividing K={k}")
    if weight.shape[0] != (k // 2 if fmt in ("int4", "mxfp4") else k) or scales.shape != (k // group, n):
        raise ValueError(f"packed weight {tuple(weight.shape)} / scales {tuple(scales.shape)} do not fit K={k}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m, block_n, block_k, chosen = choose_tiles(m, n, k, group, x.device)
    splits = splits or chosen
    if (k // block_k) % splits:
        raise ValueError(f"{splits} splits do not divide the {k // block_k} K tiles")
    partial = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else out
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), splits)
    with device_of(x):
        _quant_matmul_kernel[grid](
            x,
            weight,
            scales,
            offsets if offsets is not None else scales,
            bias if bias is not None else scales,
            partial,
            m,
            n,
            x.stride(0),
            weight.stride(0),
            scales.stride(0),
            n,
            m * n,
            group,
            k // splits,
            FORMAT=FORMAT_CODES[fmt],
            HAS_OFFSETS=offsets is not None,
            HAS_BIAS=bias is not None,
            SPLIT=splits > 1,
            DOT_FP32=interpreting() or x.dtype == torch.float32,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            num_warps=4,
            num_stages=3 if m > 16 else 4,
        )
        if splits > 1:
            block = 1024
            _sum_splits_kernel[(triton.cdiv(m * n, block),)](
                partial,
                bias if bias is not None else partial,
                out,
                m * n,
                n,
                SPLITS=splits,
                HAS_BIAS=bias is not None,
                BLOCK=block,
            )
    return out


@triton.jit
def _quantize_rows_fp8_kernel(x_ptr, q_ptr, scale_ptr, K, stride_xm, stride_qm, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_xm + cols, mask=cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    # IEEE division (Triton's `/` is approximate on NVIDIA GPUs): the rounding to e4m3 then
    # matches torch's ``x / scale`` bit for bit
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, 0), 1e-12), 448.0)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_xm + cols, mask=cols < K, other=0.0).to(tl.float32)
        q = round_to_e4m3(tl.math.div_rn(x, scale))
        tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=cols < K)


def quantize_rows_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """Dynamic per-token FP8: ``(q [M, K] float8_e4m3fn, scale [M, 1] float32)`` with ``scale =
    max|x_row| / 448`` (at least 1e-12 / 448) and ``q = round(x / scale)``, so ``q * scale ~ x``."""
    m, k = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block = min(triton.next_power_of_2(k), 1024)
        with device_of(x):
            _quantize_rows_fp8_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), BLOCK=block, num_warps=4)
    return q, scale
