"""compressed-tensors checkpoints (llm-compressor): ``quant_method`` ``compressed-tensors`` in
the formats ``pack-quantized`` (W4A16, W8A16), ``float-quantized`` (W8A8-FP8) and
``int-quantized`` (W8A8-INT8).

The config's ``config_groups`` each give a quantization scheme (``weights``: ``num_bits``,
``type`` int or float, ``symmetric``, ``strategy`` tensor / channel / group / block,
``group_size``, ``block_structure``; ``input_activations``) and the modules it ``targets``
(``Linear``, a name, or ``re:`` and a regular expression); ``ignore`` lists the modules left
unquantized (names or ``re:`` expressions). A quantized linear ``[N, K]`` is stored as

* ``pack-quantized``: ``weight_packed`` int32 ``[N, ceil(K * bits / 32)]``, the values packed
  along the input axis lowest bits first, each stored unsigned as ``q + 2^(bits-1)``;
  ``weight_shape`` ``[N, K]``; ``weight_scale`` ``[N, K / G]`` (group) or ``[N, 1]`` (channel);
  asymmetric: ``weight_zero_point`` int32 ``[ceil(N * bits / 32), K / G]``, packed along the
  output axis the same way; act-order: ``weight_g_idx`` ``[K]``. ``w = (q - zp) * s``.
* ``float-quantized``: ``weight`` float8_e4m3fn and ``weight_scale`` (one, per row, or per
  block): ``w = float(q) * s``.
* ``int-quantized``: ``weight`` int8 and ``weight_scale`` (per row or per group), asymmetric with
  ``weight_zero_point`` int8 shaped as the scales: ``w = (q - zp) * s``.

W8A8 schemes also quantize the activations (per token, dynamically, or with a static
``input_scale``). Sonar runs these layers weight-only: activations stay in the model's dtype and
a static ``input_scale`` is checked but not used.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from sonar.kernels.quant import QuantizedWeight
from sonar.models.errors import ModelLoadError
from sonar.models.quantization.fp8 import check_input_scale, fp8_weight
from sonar.models.quantization.method import (
    LINEAR_MODULE,
    Method,
    act_order,
    block_scales,
    check_shape,
    from_unsigned,
    group_scales,
    need,
)
from sonar.models.quantization.packing import unpack_int32

FORMATS = ("pack-quantized", "float-quantized", "int-quantized")
STRATEGIES = {
    "pack-quantized": ("group", "channel"),
    "float-quantized": ("tensor", "channel", "block"),
    "int-quantized": ("tensor", "channel", "group"),
}


@dataclass(frozen=True)
class Scheme:
    """One config group's weight quantization, as Sonar reads it."""

    format: str
    bits: int
    symmetric: bool
    strategy: str
    group_size: int | None
    block: tuple[int, int] | None
    static_input: bool
    targets: tuple[str, ...]


def _matches(module: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return pattern == module or (pattern == "Linear" and LINEAR_MODULE.fullmatch(module) is not None)


def _scheme(name: str, group: dict[str, Any], top_format: str | None) -> Scheme:
    fmt = group.get("format") or top_format
    if fmt not in FORMATS:
        raise ModelLoadError(f"compressed-tensors format {fmt!r} is not supported ({', '.join(FORMATS)})")
    w = group.get("weights")
    if not isinstance(w, dict):
        raise ModelLoadError(f"compressed-tensors config group {name} quantizes no weights; Sonar needs weight schemes")
    if group.get("output_activations"):
        raise ModelLoadError(f"compressed-tensors config group {name}: output_activations are not supported")
    bits, kind = w.get("num_bits"), w.get("type", "int")
    expected = {"pack-quantized": ("int", (4, 8)), "float-quantized": ("float", (8,)), "int-quantized": ("int", (8,))}
    want_type, want_bits = expected[fmt]
    if kind != want_type or bits not in want_bits:
        raise ModelLoadError(
            f"compressed-tensors {fmt} with {bits}-bit {kind} weights is not supported "
            f"({' or '.join(map(str, want_bits))}-bit {want_type})"
        )
    strategy = w.get("strategy", "tensor")
    if strategy not in STRATEGIES[fmt]:
        raise ModelLoadError(
            f"compressed-tensors {fmt} strategy {strategy!r} is not supported ({', '.join(STRATEGIES[fmt])})"
        )
    symmetric = bool(w.get("symmetric", True))
    if not symmetric and fmt == "float-quantized":
        raise ModelLoadError("compressed-tensors float-quantized asymmetric weights are not supported")
    if w.get("dynamic"):
        raise ModelLoadError(f"compressed-tensors config group {name}: dynamic weight quantization is not supported")
    group_size = w.get("group_size")
    if strategy == "group" and not (isinstance(group_size, int) and group_size > 0):
        raise ModelLoadError(f"compressed-tensors config group {name}: group strategy needs a positive group_size")
    block = w.get("block_structure")
    if strategy == "block" and not (isinstance(block, list) and len(block) == 2):
        raise ModelLoadError(
            f"compressed-tensors config group {name}: block strategy needs block_structure [rows, columns]"
        )
    acts = group.get("input_activations")
    static = isinstance(acts, dict) and not acts.get("dynamic", False)
    targets = tuple(group.get("targets") or ())
    return Scheme(fmt, bits, symmetric, strategy, group_size, tuple(block) if block else None, static, targets)


class CompressedTensors(Method):
    name = "compressed-tensors"
    parts = frozenset(
        {"weight", "weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight_g_idx", "input_scale"}
    )

    def __init__(self, schemes: list[Scheme], ignore: list[str]) -> None:
        self.schemes = schemes
        self.ignore = ignore

    @classmethod
    def from_config(cls, qc: dict[str, Any]) -> CompressedTensors:
        status = qc.get("quantization_status", "compressed")
        if status != "compressed":
            raise ModelLoadError(
                f"compressed-tensors quantization_status {status!r} is not supported (Sonar reads compressed checkpoints)"
            )
        sparsity = qc.get("sparsity_config") or {}
        if sparsity.get("format") not in (None, "dense"):
            raise ModelLoadError(f"compressed-tensors sparsity format {sparsity.get('format')!r} is not supported")
        if qc.get("kv_cache_scheme"):
            raise ModelLoadError(
                "compressed-tensors kv_cache_scheme is not supported (Sonar's --kv-cache-dtype sets the cache)"
            )
        if qc.get("transform_config"):
            raise ModelLoadError(
                "compressed-tensors transform_config (rotated weights needing online transforms) is not supported"
            )
        groups = qc.get("config_groups") or {}
        if not groups:
            raise ModelLoadError("compressed-tensors quantization_config has no config_groups")
        schemes = [_scheme(name, group, qc.get("format")) for name, group in groups.items()]
        return cls(schemes, list(qc.get("ignore") or []))

    def scheme_for(self, module: str) -> Scheme | None:
        if any(_matches(module, pattern) for pattern in self.ignore):
            return None
        if len(self.schemes) == 1:
            return self.schemes[0]
        return next((s for s in self.schemes if any(_matches(module, t) for t in s.targets)), None)

    def quantized(self, module: str, parts: set[str]) -> bool:
        if not parts & {"weight_packed", "weight_scale"}:
            return False
        if self.scheme_for(module) is None:
            raise ModelLoadError(
                f"{module} is stored quantized, but the compressed-tensors config's ignore list and targets "
                "give it no scheme"
            )
        return True

    def convert(self, module: str, tensors: dict[str, Tensor]) -> QuantizedWeight:
        scheme = self.scheme_for(module)
        assert scheme is not None  # `quantized` said so
        if scheme.static_input:
            check_input_scale(tensors, module)
        if scheme.format == "pack-quantized":
            return self._packed(scheme, module, tensors)
        if scheme.format == "float-quantized":
            weight = fp8_weight(tensors, module)
            n, k = weight.shape
            scale = need(tensors, module, "weight_scale")
            if scheme.block is not None:
                scales, group = block_scales(scale, n, k, scheme.block, module, "weight_scale")
            else:
                scales, group = group_scales(scale, n, k, module)
            return QuantizedWeight("fp8", weight, scales, None, group)
        weight = need(tensors, module, "weight")
        if weight.dtype != torch.int8 or weight.dim() != 2:
            raise ModelLoadError(f"{module}.weight is {weight.dtype}; an int-quantized weight is an int8 matrix")
        n, k = weight.shape
        scales, group = self._scales(scheme, tensors, module, n, k)
        offsets = None
        if not scheme.symmetric:
            zp = need(tensors, module, "weight_zero_point")
            check_shape(zp, tuple(tensors["weight_scale"].shape), module, "weight_zero_point")
            offsets = -(zp.to(torch.float32).reshape(scales.shape) * scales)
        perm, values = self._act_order(tensors, module, k, group, weight)
        return QuantizedWeight("int8", values, scales, offsets, group, perm)

    def _scales(self, scheme: Scheme, tensors: dict[str, Tensor], module: str, n: int, k: int) -> tuple[Tensor, int]:
        size = scheme.group_size
        if scheme.strategy == "group" and k % size:
            raise ModelLoadError(
                f"{module}: compressed-tensors group_size {size} does not divide its {k} input features"
            )
        scales, group = group_scales(need(tensors, module, "weight_scale"), n, k, module)
        if scheme.strategy == "group" and group != size:
            raise ModelLoadError(
                f"{module}.weight_scale holds {scales.shape[1]} scales per row; groups of {size} need {k // size}"
            )
        return scales, group

    def _act_order(
        self, tensors: dict[str, Tensor], module: str, k: int, group: int, values: Tensor
    ) -> tuple[Tensor | None, Tensor]:
        g_idx = tensors.get("weight_g_idx")
        perm = None if g_idx is None else act_order(g_idx, k, group, module)
        return perm, values if perm is None else values[:, perm]

    def _packed(self, scheme: Scheme, module: str, tensors: dict[str, Tensor]) -> QuantizedWeight:
        packed = need(tensors, module, "weight_packed")
        shape = need(tensors, module, "weight_shape")
        if shape.numel() != 2:
            raise ModelLoadError(f"{module}.weight_shape must hold [out_features, in_features]")
        n, k = (int(v) for v in shape.tolist())
        per = 32 // scheme.bits
        check_shape(packed, (n, -(-k // per)), module, "weight_packed")
        fields = unpack_int32(packed, scheme.bits, dim=1)[:, :k]
        scales, group = self._scales(scheme, tensors, module, n, k)
        zeros: Tensor | int = 1 << (scheme.bits - 1)  # the unsigned storage offset: signed zero
        if not scheme.symmetric:
            zp = need(tensors, module, "weight_zero_point")
            check_shape(zp, (-(-n // per), scales.shape[1]), module, "weight_zero_point")
            zeros = unpack_int32(zp, scheme.bits, dim=0)[:n]
        perm, fields = self._act_order(tensors, module, k, group, fields)
        return from_unsigned(fields, scheme.bits, scales, zeros, group, perm)

    def describe(self) -> dict[str, object]:
        return {
            "schemes": [f"{s.format} {s.bits}-bit {s.strategy}" for s in self.schemes],
            "ignore": self.ignore,
        }
