"""Quantized linear weights: one logical layout for every quantized format Sonar serves, and its
torch reference.

Every format a checkpoint brings (GGUF blocks, GPTQ and AWQ packs, FP8 with scales,
compressed-tensors) is converted on load, exactly, into a `QuantizedWeight`: per weight a small
integer (or an FP8 value) and, per group of `group` consecutive input columns of one output row, a
float32 scale and optionally a float32 offset::

    w[n, k] = values[n, k] * scales[n, k // group] + offsets[n, k // group]

float32 holds every scale those formats produce without rounding (a GGUF K-quant's super-block
scale times its 6-bit sub-block scale, a GPTQ fp16 scale), so the layout is exact for them. The
backends (`sonar.kernels.quant_cpu`, the native CPU kernels; `sonar.kernels.quant_triton`, on
CUDA) pack the layout for their kernels; `dequantize` and `reference_linear` are the reference
they are tested against.

GPTQ's act-order (``desc_act``) assigns input columns to groups out of order; the converter sorts
the columns by group and records the order in `perm`: the layer computes ``x[:, perm] @ w.T``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor

from sonar.errors import SonarError

Format = Literal["int4", "int8", "fp8"]

#: The value range of each format (what `values` may hold): int4 is stored unsigned, one value a
#: uint8 element in the logical layout (the backends pack two per byte).
VALUE_DTYPES: dict[str, torch.dtype] = {"int4": torch.uint8, "int8": torch.int8, "fp8": torch.float8_e4m3fn}


class QuantizationError(SonarError, ValueError):
    """A quantized weight that is malformed or that a kernel cannot serve (the message says which)."""


@dataclass(frozen=True)
class QuantizedWeight:
    """A ``[out_features, in_features]`` weight in the logical layout above.

    `values`: ``[N, K]`` of `VALUE_DTYPES[format]` (int4: uint8 in 0..15); `scales` and `offsets`:
    ``[N, K // group]`` float32 (`offsets` None: zero); `perm`: ``[K]`` int64 or None.
    """

    format: Format
    values: Tensor
    scales: Tensor
    offsets: Tensor | None
    group: int
    perm: Tensor | None = None

    def __post_init__(self) -> None:
        if self.format not in VALUE_DTYPES:
            raise QuantizationError(f"unknown quantized format {self.format!r} ({', '.join(VALUE_DTYPES)})")
        if self.values.dim() != 2 or self.values.dtype != VALUE_DTYPES[self.format]:
            raise QuantizationError(
                f"{self.format} values must be a [N, K] {VALUE_DTYPES[self.format]} matrix, "
                f"got {self.values.dtype} {tuple(self.values.shape)}"
            )
        n, k = self.values.shape
        if self.group <= 0 or k % self.group:
            raise QuantizationError(f"group size {self.group} does not divide the {k} input columns")
        expected = (n, k // self.group)
        for name, t in (("scales", self.scales), ("offsets", self.offsets)):
            if t is not None and (tuple(t.shape) != expected or t.dtype != torch.float32):
                raise QuantizationError(f"{name} must be float32 {expected}, got {t.dtype} {tuple(t.shape)}")
        if self.perm is not None and tuple(self.perm.shape) != (k,):
            raise QuantizationError(f"perm must hold the {k} input columns, got {tuple(self.perm.shape)}")

    @property
    def out_features(self) -> int:
        return self.values.shape[0]

    @property
    def in_features(self) -> int:
        return self.values.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of the layout as a backend stores it (int4 two values per byte)."""
        values = self.values.numel() // 2 if self.format == "int4" else self.values.numel()
        extra = sum(t.numel() * t.element_size() for t in (self.scales, self.offsets, self.perm) if t is not None)
        return values + extra

    def to(self, device: torch.device | str) -> QuantizedWeight:
        def move(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(device)

        return replace(
            self,
            values=self.values.to(device),
            scales=self.scales.to(device),
            offsets=move(self.offsets),
            perm=move(self.perm),
        )


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> Tensor:
    """The ``[N, K]`` weight in the input's column order (``perm`` undone), in `dtype`."""
    scales = qw.scales.repeat_interleave(qw.group, dim=1)
    w = qw.values.to(torch.float32) * scales
    if qw.offsets is not None:
        w = w + qw.offsets.repeat_interleave(qw.group, dim=1)
    if qw.perm is not None:
        w = torch.empty_like(w).index_copy_(1, qw.perm, w)
    return w.to(dtype)


def reference_linear(x: Tensor, qw: QuantizedWeight, bias: Tensor | None = None) -> Tensor:
    """``x @ dequantize(qw).T + bias`` in float32, cast to ``x``'s dtype: what every backend's
    kernel is compared with."""
    y = x.to(torch.float32) @ dequantize(qw).T
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


def _widen(qw: QuantizedWeight, group: int) -> QuantizedWeight:
    """The same weight as int8 (int4 values fit) with groups of `group` (a divisor of its own):
    exact, so weights of two formats can share one matrix."""
    values = qw.values.to(torch.int8) if qw.format == "int4" else qw.values
    repeat = qw.group // group
    return QuantizedWeight(
        "int8" if qw.format == "int4" else qw.format,
        values,
        qw.scales.repeat_interleave(repeat, dim=1),
        None if qw.offsets is None else qw.offsets.repeat_interleave(repeat, dim=1),
        group,
    )


def stack_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Weights sharing their input columns as one matrix, rows in order (q, k and v into qkv).

    Parts of one format and group stack as they are; otherwise int4 widens to int8 and groups
    split to the smallest (both exact). FP8 stacks only with FP8; parts with an input
    permutation only with parts of the same permutation.
    """
    first = parts[0]
    if any(p.in_features != first.in_features for p in parts):
        raise QuantizationError("stacked weights must share their input columns")
    perms = [p.perm for p in parts]
    if any((p is None) != (perms[0] is None) or (p is not None and not torch.equal(p, perms[0])) for p in perms):
        raise QuantizationError("weights with different input permutations (act-order) cannot be stacked")
    formats = {p.format for p in parts}
    if "fp8" in formats and len(formats) > 1:
        raise QuantizationError(f"cannot stack {' and '.join(sorted(formats))} weights")
    group = min(p.group for p in parts)
    if any(p.group % group for p in parts):
        raise QuantizationError(f"group sizes {sorted({p.group for p in parts})} do not nest")
    if len(formats) > 1 or any(p.group != group for p in parts):
        parts = [_widen(p, group) if p.format != "fp8" else p for p in parts]
        if len({p.format for p in parts}) > 1:
            raise QuantizationError("cannot stack these weights")
    with_offsets = any(p.offsets is not None for p in parts)
    offsets = (
        torch.cat([p.offsets if p.offsets is not None else torch.zeros_like(p.scales) for p in parts])
        if with_offsets
        else None
    )
    return QuantizedWeight(
        parts[0].format,
        torch.cat([p.values for p in parts]),
        torch.cat([p.scales for p in parts]),
        offsets,
        group,
        perms[0],
    )
