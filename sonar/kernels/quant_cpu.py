"""The native CPU backend for quantized weights (`sonar.kernels.quant_linear.Backend`):
``torch.ops.sonar_cpu.linear_quant`` over a packing made once at load.

The packing (``sonar/kernels/csrc/cpu_ops.cpp`` reads it; its comment there says why it is laid
out so) is one uint8 tensor ``[ceil(N / 16), G, B]``: per tile of 16 output rows and per group of
`group` input columns, the group's values in 64-byte lines (16 rows x 8 columns of int4, or 16 x 4
of int8 / fp8), then the 16 rows' float32 scales, then their float32 offsets when the weight has
any. In an int8 line each row's 4 bytes are 4 consecutive columns, stored as v + 128, as
AVX512-VNNI's byte dot product reads them; int4 and fp8 lines hold bfloat16-style column pairs. A
tile is one contiguous run of bytes, so a GEMV streams the weight front to back. mxfp4 (groups of
32 E2M1 codes, one E8M0 exponent each) takes int4's lines for its codes and, in place of the
scales, the 16 rows' exponent bytes: 272 bytes per 16 x 32 block, the file's 17 per 32. It holds the
logical layout's numbers unchanged: `rows` dequantizes out of it exactly as
`sonar.kernels.quant.dequantize` does.

x is bfloat16 or float32 (`ACTIVATION_DTYPES`), y of x's dtype; mxfp4 always multiplies in float32
(AVX2 or the portable loop: its values and scales are exact there, and x is never rounded). Three paths read the packing, the
fastest this CPU runs chosen at run time (`sonar.kernels.native.quant_isa`): AVX-512 (bfloat16 x on
CPUs with AVX512-VNNI and AVX512-BF16: int8 quantizes each row of x to int8 per group, as
llama.cpp does, the output carrying that error, at most scale_x / 2 * sum |w| per group, and
multiplies in integers; int4 and fp8 unpack to bfloat16 in registers, exact); AVX2 + FMA (float32
x, and bfloat16 x widened to float32, on every CPU with AVX2: every format unpacked to float32 in
registers, no activation rounding); a portable loop (bfloat16 x as the AVX-512 path computes it,
float32 x as the AVX2 one). float16 x gets the reference arithmetic on the weight dequantized from
the packing. An act-order permutation gathers x's columns before the kernel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from sonar.kernels import native, quant
from sonar.kernels.quant import QuantizedWeight

if TYPE_CHECKING:  # quant_linear imports this module to find the backend
    from sonar.kernels.quant_linear import QuantMeta

#: The kernel's format codes.
FORMAT_CODES: dict[str, int] = {"int4": 0, "int8": 1, "fp8": 2, "mxfp4": 3}
#: Input columns per 64-byte line of a tile (16 rows each): groups are whole lines.
COLUMNS_PER_LINE: dict[str, int] = {"int4": 8, "int8": 4, "fp8": 4, "mxfp4": 8}
_NIBBLES = ("int4", "mxfp4")
TILE = 16
#: The activation dtypes the kernel takes; others run the reference on the dequantized weight.
ACTIVATION_DTYPES = (torch.bfloat16, torch.float32)


def _group_bytes(meta: QuantMeta) -> int:
    return meta.group // COLUMNS_PER_LINE[meta.format] * 64


def pack(qw: QuantizedWeight) -> Tensor:
    """`qw` as ``linear_quant`` reads it (see the module docstring); ``perm`` is not part of it."""
    n, k = qw.values.shape
    tiles, groups = -(-n // TILE), k // qw.group
    pad = tiles * TILE - n
    values = qw.values if qw.format in _NIBBLES else qw.values.view(torch.uint8)
    lines = qw.group // COLUMNS_PER_LINE[qw.format]
    values = torch.cat((values, values.new_zeros(pad, k))) if pad else values
    if qw.format in _NIBBLES:
        # k = g * group + line * 8 + 2 * pair + parity; one 16-bit word per (row, parity) holds the
        # four pairs' nibbles
        v = values.reshape(tiles, TILE, groups, lines, 4, 2).permute(0, 2, 3, 1, 5, 4)
        body = torch.stack((v[..., 0] | v[..., 1] << 4, v[..., 2] | v[..., 3] << 4), dim=-1)
    elif qw.format == "int8":
        # k = g * group + line * 4 + j: bytes in (row, j) order, v + 128 (unsigned)
        body = values.reshape(tiles, TILE, groups, lines, 4).permute(0, 2, 3, 1, 4) ^ 0x80
    else:
        # k = g * group + line * 4 + 2 * pair + parity; bytes in (pair, row, parity) order
        body = values.reshape(tiles, TILE, groups, lines, 2, 2).permute(0, 2, 3, 4, 1, 5)
    parts = [body.reshape(tiles, groups, lines * 64)]
    if qw.format == "mxfp4":  # the rows' exponent bytes after the group's lines
        e = quant.mxfp4_exponents(qw.scales)
        e = torch.cat((e, e.new_zeros(pad, groups))) if pad else e
        parts.append(e.reshape(tiles, TILE, groups).permute(0, 2, 1))
        return torch.cat(parts, dim=2).contiguous()
    for t in (qw.scales, qw.offsets):
        if t is not None:
            t = torch.cat((t, t.new_zeros(pad, groups))) if pad else t
            parts.append(t.reshape(tiles, TILE, groups).permute(0, 2, 1).contiguous().view(torch.uint8))
    return torch.cat(parts, dim=2).contiguous()


def unpack_rows(packed: Tensor, meta: QuantMeta, index: Tensor, perm: Tensor | None = None) -> QuantizedWeight:
    """Rows `index` of a packed weight back in the logical layout (values, scales and offsets
    exactly as they were packed)."""
    index = index.to(torch.int64)
    n = index.numel()
    tiles, columns = index // TILE, index % TILE
    picked = packed[tiles]
    groups, lines, gb = picked.shape[1], meta.group // COLUMNS_PER_LINE[meta.format], _group_bytes(meta)
    who = torch.arange(n)
    body = picked[..., :gb]
    if meta.format in _NIBBLES:
        b = body.reshape(n, groups, lines, TILE, 2, 2)[who, :, :, columns].to(torch.int32)  # [n, G, lines, parity, 2]
        words = b[..., 0] | b[..., 1] << 8
        nibbles = (words.unsqueeze(-1) >> torch.arange(0, 16, 4, dtype=torch.int32)) & 0xF  # [.., parity, pair]
        values = nibbles.transpose(-1, -2).reshape(n, -1).to(torch.uint8)
    elif meta.format == "int8":
        b = body.reshape(n, groups, lines, TILE, 4)[who, :, :, columns]
        values = (b ^ 0x80).reshape(n, -1).view(torch.int8)
    else:
        b = body.reshape(n, groups, lines, 2, TILE, 2)[who, :, :, :, columns]  # [n, G, lines, pair, parity]
        values = b.reshape(n, -1).view(quant.VALUE_DTYPES[meta.format])

    def meta_line(i: int) -> Tensor:
        line = picked[..., gb + 64 * i : gb + 64 * (i + 1)].contiguous().view(torch.float32)
        return line[who, :, columns]

    if meta.format == "mxfp4":
        scales = quant.mxfp4_scales(picked[..., gb : gb + TILE][who, :, columns])
        return QuantizedWeight(meta.format, values, scales, None, meta.group)
    return QuantizedWeight(
        meta.format, values, meta_line(0), meta_line(1) if meta.has_offsets else None, meta.group, perm
    )


class NativeBackend:
    """Quantized weights on the CPU through ``torch.ops.sonar_cpu.linear_quant``."""

    name = "native"

    def serves(self, qw: QuantizedWeight) -> bool:
        return (
            qw.values.device.type == "cpu"
            and qw.format in FORMAT_CODES
            and qw.group % COLUMNS_PER_LINE[qw.format] == 0
            and native.available()
        )

    def pack(self, qw: QuantizedWeight) -> dict[str, Tensor]:
        packed = {"packed": pack(qw)}
        if qw.perm is not None:
            packed["perm"] = qw.perm
        return packed

    def linear(self, x: Tensor, packed: dict[str, Tensor], meta: QuantMeta, bias: Tensor | None) -> Tensor:
        perm = packed.get("perm")
        if x.dtype not in ACTIVATION_DTYPES or not native.available():
            index = torch.arange(meta.out_features)
            return quant.reference_linear(x, unpack_rows(packed["packed"], meta, index, perm), bias)
        if perm is not None:
            x = x.index_select(1, perm)
        return torch.ops.sonar_cpu.linear_quant(
            x.contiguous(),
            packed["packed"],
            None if bias is None else bias.to(x.dtype),
            FORMAT_CODES[meta.format],
            meta.out_features,
            meta.group,
            meta.has_offsets,
        )

    def rows(self, packed: dict[str, Tensor], meta: QuantMeta, index: Tensor, dtype: torch.dtype) -> Tensor:
        return quant.dequantize(unpack_rows(packed["packed"], meta, index, packed.get("perm")), dtype)
