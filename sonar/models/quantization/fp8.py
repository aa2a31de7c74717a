"""FP8 weights: checkpoints with ``quant_method`` ``fp8`` and ``--quantization fp8`` on an
unquantized checkpoint (quantized at load).

A checkpoint stores an FP8 linear ``[N, K]`` as ``weight`` float8_e4m3fn and either

* ``weight_scale_inv`` float32 ``[ceil(N / bn), ceil(K / bk)]``, one scale per ``[bn, bk]`` block
  (``weight_block_size``, DeepSeek-V3 and Qwen3 FP8 style): ``w = float(q) * s[n // bn, k // bk]``
  (the name says the scale is the inverse of the one quantization divided by);
* or ``weight_scale``, one float32 for the tensor (``[]`` or ``[1]``), or one per output row:
  ``w = float(q) * s``;

and with ``activation_scheme`` ``static`` a float32 ``input_scale`` per layer: the scale the
activations were calibrated to. Sonar runs FP8 weights with activations in the model's dtype, so
the input scales are checked (present, positive, finite) and otherwise not used: the layer is the
dequantized weight times unquantized activations.

Quantizing at load: every linear layer of the decoder (a mixture-of-experts model's experts too,
stored one tensor per expert; stacked ones are refused), per output row, ``s = amax(|w|) / 448``
(448 is float8_e4m3fn's largest value) and ``q = fp8(w / s)``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from sonar.kernels.quant import QuantizedWeight
from sonar.models.errors import ModelLoadError
from sonar.models.quantization.method import LINEAR_MODULE, Method, block_scales, group_scales, listed, need

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
STACKED_EXPERTS = frozenset({"gate_up_proj", "down_proj"})
ACTIVATION_SCHEMES = ("dynamic", "static")


def quantize_dynamic_fp8(weight: Tensor) -> QuantizedWeight:
    """`weight` ``[N, K]`` as float8_e4m3fn with one float32 scale per output row (an all-zero row
    gets scale 1)."""
    w = weight.to(torch.float32)
    amax = w.abs().amax(dim=1, keepdim=True)
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    values = (w / scales).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return QuantizedWeight("fp8", values, scales, None, w.shape[1])


def fp8_weight(tensors: dict[str, Tensor], module: str) -> Tensor:
    weight = need(tensors, module, "weight")
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ModelLoadError(
            f"{module}.weight is {weight.dtype} {tuple(weight.shape)}; an FP8 layer's weight is a float8_e4m3fn matrix"
        )
    return weight


def check_input_scale(tensors: dict[str, Tensor], module: str) -> None:
    """A static activation scheme's ``input_scale``: present, positive and finite (and unused)."""
    scale = need(tensors, module, "input_scale").to(torch.float32)
    if scale.numel() == 0 or not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
        raise ModelLoadError(f"{module}.input_scale must hold positive finite scales")


class FP8(Method):
    """A checkpoint's FP8 weights (``quant_method`` ``fp8``)."""

    name = "fp8"
    parts = frozenset({"weight", "weight_scale", "weight_scale_inv", "input_scale"})

    def __init__(self, block: tuple[int, int] | None, static: bool, skip: list[str]) -> None:
        self.block = block
        self.static = static
        self.skip = skip

    @classmethod
    def from_config(cls, qc: dict[str, Any]) -> FP8:
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ModelLoadError(f"FP8 fmt {fmt!r} is not supported (e4m3)")
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in ACTIVATION_SCHEMES:
            raise ModelLoadError(f"FP8 activation_scheme {scheme!r} is not supported ({', '.join(ACTIVATION_SCHEMES)})")
        block = qc.get("weight_block_size")
        if block is not None:
            if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
                raise ModelLoadError(f"FP8 weight_block_size {block!r} must be two positive integers [rows, columns]")
            if scheme == "static":
                raise ModelLoadError("FP8 block scales (weight_block_size) with a static activation_scheme")
        skip = list(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or [])
        return cls(None if block is None else (block[0], block[1]), scheme == "static", skip)

    @property
    def scale_part(self) -> str:
        return "weight_scale" if self.block is None else "weight_scale_inv"

    def quantized(self, module: str, parts: set[str]) -> bool:
        if self.scale_part not in parts:
            return False
        if listed(module, self.skip):
            raise ModelLoadError(f"{module} is in modules_to_not_convert, but the checkpoint stores it as FP8")
        return True

    def convert(self, module: str, tensors: dict[str, Tensor]) -> QuantizedWeight:
        weight = fp8_weight(tensors, module)
        n, k = weight.shape
        scale = need(tensors, module, self.scale_part)
        if self.block is None:
            scales, group = group_scales(scale, n, k, module, self.scale_part)
            if group != k:
                raise ModelLoadError(
                    f"{module}.weight_scale: FP8 without weight_block_size has one scale per tensor or row"
                )
        else:
            scales, group = block_scales(scale, n, k, self.block, module, self.scale_part)
        if self.static:
            check_input_scale(tensors, module)
        if not bool(torch.isfinite(scales).all()):
            raise ModelLoadError(f"{module}.{self.scale_part} holds non-finite scales")
        return QuantizedWeight("fp8", weight, scales, None, group)

    def describe(self) -> dict[str, object]:
        return {
            "weight_block_size": None if self.block is None else list(self.block),
            "activation_scheme": "static" if self.static else "dynamic",
        }


class DynamicFP8(Method):
    """``--quantization fp8`` on an unquantized checkpoint: every decoder linear layer (not the
    output layer) quantized per output row as it loads (`quantize_dynamic_fp8`)."""

    name = "fp8"
    #: ``weight``, and the names of experts stacked as transformers holds them in memory
    #: (``mlp.experts.gate_up_proj`` ``[E, 2 I, h]``), which are refused
    parts = frozenset({"weight", *STACKED_EXPERTS})

    def quantized(self, module: str, parts: set[str]) -> bool:
        if parts & STACKED_EXPERTS:
            raise ModelLoadError(
                f"--quantization fp8 quantizes a mixture-of-experts checkpoint's experts stored one tensor per "
                f"expert and projection (what save_pretrained writes), not {module}'s stacked "
                f"{' and '.join(sorted(parts & STACKED_EXPERTS))}"
            )
        return "weight" in parts and module != "lm_head" and LINEAR_MODULE.fullmatch(module) is not None

    def convert(self, module: str, tensors: dict[str, Tensor]) -> QuantizedWeight:
        weight = need(tensors, module, "weight")
        if not weight.is_floating_point() or weight.element_size() < 2 or weight.dim() != 2:
            raise ModelLoadError(f"{module}.weight is {weight.dtype}; --quantization fp8 quantizes float weights")
        if not bool(torch.isfinite(weight).all()):
            raise ModelLoadError(f"{module}.weight holds non-finite values; it cannot be quantized to FP8")
        return quantize_dynamic_fp8(weight)

    def describe(self) -> dict[str, object]:
        return {"dynamic": True, "granularity": "per output channel", "fp8_max": math.floor(FP8_MAX)}
