"""The CUDA backend of `sonar.kernels.quant_linear`: Triton's dequantize-in-the-loop GEMM
(`sonar.kernels.triton.quant_matmul`) for int4, int8 and FP8 weights, and ``torch._scaled_mm``
for FP8 weights with per-channel scales where the GPU runs FP8 matmuls.

Packed tensors (`TritonBackend.pack`; the layer keeps nothing else):

- ``qweight``: the values transposed to ``[K, N]`` (int8, or FP8's bits as uint8), int4 and
  MXFP4's codes two per byte along K, ``[K // 2, N]``; ``scales`` and ``offsets`` ``[K // group, N]``
  float32 as the logical layout holds them (exact; fp16 scales would round GGUF K-quant scales),
  MXFP4's ``exponents`` ``[K // 32, N]`` uint8 instead of scales (17 bytes per 32 weights, as
  the other backends keep them);
- ``fp8_weight`` ``[N, K]`` float8_e4m3fn and ``fp8_scale`` ``[1, N]`` instead, for
  ``torch._scaled_mm``: FP8 with one scale per output row (``group == K``), no offsets, on a GPU
  of compute capability 8.9 or newer whose torch runs row-wise scaled FP8 matmuls. Activations
  are quantized per token (``max|x_row| / 448``) by a Triton kernel, so this path differs from
  the reference by that quantization (e4m3 keeps 3 mantissa bits: a relative error up to 2**-4
  per activation), where the Triton path only differs by float32 summation order;
- ``perm``: GPTQ act-order, the input columns gathered (``x[:, perm]``) before the kernel.

The kernels are imported on the first call, as in `sonar.kernels.ops`: importing this module
never imports Triton. `TritonBackend.serves` CUDA weights only (``SONAR_USE_TRITON=0`` turns it
off, as for the other kernels); `pack`, `linear` and `rows` also run on CPU tensors under
``TRITON_INTERPRET=1``, which is how the CPU tests check them.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from sonar.kernels import ops, quant
from sonar.kernels.quant import QuantizedWeight

if TYPE_CHECKING:  # quant_linear imports this module to list its backends
    from sonar.kernels.quant_linear import QuantMeta

SCALED_MM_MIN_CAPABILITY = (8, 9)


@functools.cache
def _kernels() -> ModuleType:
    from sonar.kernels.triton import quant_matmul

    return quant_matmul


@functools.cache
def scaled_mm_supported(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` with row-wise scales runs on `device` (compute capability 8.9
    or newer, and a torch build that has it there): tried once on a tiny product."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < SCALED_MM_MIN_CAPABILITY:
        return False
    a = torch.zeros((16, 32), device=device).to(torch.float8_e4m3fn)
    b = torch.zeros((16, 32), device=device).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(
            a,
            b.t(),
            scale_a=torch.ones((16, 1), device=device),
            scale_b=torch.ones((1, 16), device=device),
            out_dtype=torch.bfloat16,
        )
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _uses_scaled_mm(qw: QuantizedWeight) -> bool:
    return (
        qw.format == "fp8"
        and qw.group == qw.in_features
        and qw.offsets is None
        and qw.out_features % 16 == 0
        and qw.in_features % 16 == 0
        and scaled_mm_supported(qw.values.device)
    )


def pack_int4(values: Tensor) -> Tensor:
    """``[N, K]`` uint8 values 0..15 as ``[K // 2, N]`` bytes, column ``2j`` in the low nibble."""
    t = values.t()
    return (t[0::2] | (t[1::2] << 4)).contiguous()


def unpack_int4(packed: Tensor) -> Tensor:
    """The inverse of `pack_int4` for any set of packed columns: ``[K // 2, L]`` -> ``[L, K]``."""
    low, high = packed & 0xF, packed >> 4
    return torch.stack((low, high), dim=1).reshape(-1, packed.shape[1]).t()


def scales_of(packed: dict[str, Tensor]) -> Tensor:
    """The packed scales the kernel reads: float32 ``scales``, or MXFP4's ``exponents``."""
    return packed["scales"] if "scales" in packed else packed["exponents"]


class TritonBackend:
    """Quantized linear layers on CUDA through Triton (and ``torch._scaled_mm`` for FP8)."""

    name = "triton"

    def serves(self, qw: QuantizedWeight) -> bool:
        return qw.values.is_cuda and ops.use_triton(qw.values) and _kernels().check_group(qw.group, qw.in_features)

    def pack(self, qw: QuantizedWeight) -> dict[str, Tensor]:
        packed: dict[str, Tensor] = {}
        if _uses_scaled_mm(qw):
            packed["fp8_weight"] = qw.values.contiguous()
            packed["fp8_scale"] = qw.scales.reshape(1, -1).contiguous()
        else:
            if qw.format in ("int4", "mxfp4"):
                packed["qweight"] = pack_int4(qw.values)
            else:
                values = qw.values.view(torch.uint8) if qw.format == "fp8" else qw.values
                packed["qweight"] = values.t().contiguous()
            if qw.format == "mxfp4":
                packed["exponents"] = quant.mxfp4_exponents(qw.scales).t().contiguous()
            else:
                packed["scales"] = qw.scales.t().contiguous()
            if qw.offsets is not None:
                packed["offsets"] = qw.offsets.t().contiguous()
        if qw.perm is not None:
            packed["perm"] = qw.perm
        return packed

    def linear(self, x: Tensor, packed: dict[str, Tensor], meta: QuantMeta, bias: Tensor | None) -> Tensor:
        perm = packed.get("perm")
        if perm is not None:
            x = x.index_select(1, perm)
        if "fp8_weight" in packed:
            return self._scaled_mm(x, packed["fp8_weight"], packed["fp8_scale"], bias)
        return _kernels().quant_matmul(
            x, packed["qweight"], scales_of(packed), packed.get("offsets"), meta.format, meta.group, bias
        )

    def _scaled_mm(self, x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
        if not x.shape[0]:
            return x.new_empty((0, weight.shape[0]))
        xq, x_scale = _kernels().quantize_rows_fp8(x)
        y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale, out_dtype=torch.bfloat16)
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.to(x.dtype)

    def rows(self, packed: dict[str, Tensor], meta: QuantMeta, index: Tensor, dtype: torch.dtype) -> Tensor:
        if "fp8_weight" in packed:
            values, scales, offsets = packed["fp8_weight"][index], packed["fp8_scale"][0, index, None], None
        else:
            columns = packed["qweight"][:, index]
            if meta.format in ("int4", "mxfp4"):
                values = unpack_int4(columns)
            elif meta.format == "fp8":
                values = columns.t().view(torch.float8_e4m3fn)
            else:
                values = columns.t()
            scales = scales_of(packed)[:, index].t()
            if meta.format == "mxfp4":
                scales = quant.mxfp4_scales(scales)
            offsets = packed["offsets"][:, index].t() if "offsets" in packed else None
        picked = QuantizedWeight(meta.format, values, scales, offsets, meta.group, packed.get("perm"))
        return quant.dequantize(picked, dtype)
