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

MXFP4 (GGUF's, OCP microscaling) fits the same formula: `values` are the 4-bit E2M1 codes, read
through `MXFP4_VALUES` (each E2M1 value doubled: an integer), and each group of 32 has a power-of-two
scale 2^(e - 128) from its E8M0 exponent byte ``e``. The backends keep the codes and exponent bytes,
17 bytes per 32 weights (`mxfp4_exponents`), never a float32 scale.

GPTQ's act-order (``desc_act``) assigns input columns to groups out of order; the converter sorts
the columns by group and records the order in `perm`: the layer computes ``x[:, perm] @ w.T``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor

from sonar.errors import SonarError

Format = Literal["int4", "int8", "fp8", "mxfp4"]

#: The value range of each format (what `values` may hold): int4 is stored unsigned, one value a
#: uint8 element in the logical layout (the backends pack two per byte); mxfp4 the same, a 4-bit code.
VALUE_DTYPES: dict[str, torch.dtype] = {
    "int4": torch.uint8,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
    "mxfp4": torch.uint8,
}

#: MXFP4's E2M1 value of each 4-bit code, doubled (bit 3 the sign): ggml's ``kvalues_mxfp4``.
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
#: Formats whose values only stack with their own kind (`stack_rows`).
_UNWIDENED = ("fp8", "mxfp4")


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
        if self.format == "mxfp4" and (self.offsets is not None or self.perm is not None):
            raise QuantizationError("mxfp4 weights have neither offsets nor an input permutation")

    @property
    def out_features(self) -> int:
        return self.values.shape[0]

    @property
    def in_features(self) -> int:
        return self.values.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of the layout as a backend stores it (int4 and mxfp4 two values per byte, mxfp4's
        scales one exponent byte each)."""
        if self.format == "mxfp4":
            return self.values.numel() // 2 + self.scales.numel()
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


def mxfp4_exponents(scales: Tensor) -> Tensor:
    """MXFP4 scales (float32 2^(e - 128)) as their E8M0 exponent bytes ``e`` (uint8); a scale that
    is no such power of two is a `QuantizationError`."""
    mantissa, exponent = torch.frexp(scales)  # scale = mantissa 2^exponent, mantissa 0.5 for a power of two
    e = exponent.to(torch.int32) + 127
    if not bool(((mantissa == 0.5) & (e >= 0) & (e <= 255)).all()):
        raise QuantizationError("mxfp4 scales must be powers of two 2^(e - 128) with e in 0..255")
    return e.to(torch.uint8)


def mxfp4_scales(exponents: Tensor) -> Tensor:
    """E8M0 exponent bytes as their float32 scales 2^(e - 128) (exact, 2^-128 a subnormal)."""
    return torch.ldexp(torch.ones_like(exponents, dtype=torch.float32), exponents.to(torch.int32) - 128)


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> Tensor:
    """The ``[N, K]`` weight in the input's column order (``perm`` undone), in `dtype`."""
    scales = qw.scales.repeat_interleave(qw.group, dim=1)
    values = qw.values
    if qw.format == "mxfp4":
        values = torch.tensor(MXFP4_VALUES, dtype=torch.float32, device=values.device)[values.long()]
    w = values.to(torch.float32) * scales
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
    split to the smallest (both exact). FP8 and MXFP4 stack only with their own format and group;
    parts with an input permutation only with parts of the same permutation.
    """
    first = parts[0]
    if any(p.in_features != first.in_features for p in parts):
        raise QuantizationError("stacked weights must share their input columns")
    perms = [p.perm for p in parts]
    if any((p is None) != (perms[0] is None) or (p is not None and not torch.equal(p, perms[0])) for p in perms):
        raise QuantizationError("weights with different input permutations (act-order) cannot be stacked")
    formats = {p.format for p in parts}
    if any(f in formats for f in _UNWIDENED) and len(formats) > 1:
        raise QuantizationError(f"cannot stack {' and '.join(sorted(formats))} weights")
    group = min(p.group for p in parts)
    if any(p.group % group for p in parts):
        raise QuantizationError(f"group sizes {sorted({p.group for p in parts})} do not nest")
    if "mxfp4" in formats and any(p.group != group for p in parts):
        raise QuantizationError("mxfp4 weights of different group sizes cannot be stacked")
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
