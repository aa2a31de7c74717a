"""GGUF's quantized blocks as `QuantizedWeight`s: the weights of a GGUF file served as quants.

Each block type is unpacked, exactly, into the logical layout of `sonar.kernels.quant` (values,
and per group a float32 scale and offset), following ggml's own dequantization:

======  ======================================  =====================  =====  ======
type    ggml's formula, per block               values                 group  offset
======  ======================================  =====================  =====  ======
Q4_0    d * (q - 8), q 4-bit                    int4 q                 32     -8 d
Q4_1    d * q + m                               int4 q                 32     m
Q5_0    d * (q - 16), q 5-bit                   int8 q - 16            32     none
Q5_1    d * q + m                               int8 q                 32     m
Q8_0    d * q, q int8                           int8 q                 32     none
Q4_K    d sc_j * q - dmin m_j, 8 sub-blocks     int4 q                 32     -dmin m_j
Q5_K    the same with 5-bit q                   int8 q                 32     -dmin m_j
Q6_K    d sc_j * (q - 32), 16 sub-blocks        int8 q - 32            16     none
MXFP4   2^(e - 128) * kvalues[q], q 4-bit       mxfp4 q                32     none
======  ======================================  =====================  =====  ======

``d``, ``m`` and ``dmin`` are float16, ``sc_j`` and ``m_j`` 6-bit (Q6_K: int8) integers, so every
scale ``d * sc_j`` is exact in float32 and each weight comes out as ggml computes it. MXFP4's ``e``
is an E8M0 byte and ``kvalues`` its E2M1 values doubled (`sonar.kernels.quant.MXFP4_VALUES`), both
exact too. Other block types (Q2_K, Q3_K, the IQ family) are served dequantized, with a warning
naming them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from sonar.kernels.quant import QuantizedWeight

QK_K = 256


def _f16(raw: np.ndarray) -> np.ndarray:
    """Two bytes per block (the last axis) as float32 ``[blocks, 1]``."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """``[blocks, chunks * width // 2]`` bytes -> ``[blocks, chunks * width]`` values: per chunk of
    `width` values the low nibbles of its ``width / 2`` bytes first, then the high ones."""
    n = qs.shape[0]
    chunks = qs.reshape(n, -1, 1, width // 2) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (chunks & np.uint8(0x0F)).reshape(n, -1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Q5_0/Q5_1's fifth bits: a little-endian 32-bit mask per block -> ``[blocks, 32]`` 0/1."""
    bits = np.ascontiguousarray(qh).view(np.uint32).reshape(-1, 1) >> np.arange(count, dtype=np.uint32)
    return (bits & np.uint32(1)).astype(np.uint8)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit sub-block scales and mins of Q4_K/Q5_K, 12 bytes -> two ``[blocks, 8]``."""
    n = scales.shape[0]
    d, m, md = np.split(scales.reshape(n, 3, 4), 3, axis=1)
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.reshape(n, 8).astype(np.float32), mins.reshape(n, 8).astype(np.float32)


# Each unpacker: blocks [B, bytes] -> (values [B, block], scales [B, groups], offsets [B, groups] or None)
Unpacked = tuple[np.ndarray, np.ndarray, np.ndarray | None]


def _q4_0(b: np.ndarray) -> Unpacked:
    d = _f16(b[:, :2])
    return _nibbles(b[:, 2:], 32), d, -8 * d


def _q4_1(b: np.ndarray) -> Unpacked:
    return _nibbles(b[:, 4:], 32), _f16(b[:, :2]), _f16(b[:, 2:4])


def _five_bits(b: np.ndarray, qh_at: int) -> np.ndarray:
    return _nibbles(b[:, qh_at + 4 :], 32) | (_high_bits(b[:, qh_at : qh_at + 4], 32) << np.uint8(4))


def _q5_0(b: np.ndarray) -> Unpacked:
    return _five_bits(b, 2).astype(np.int8) - np.int8(16), _f16(b[:, :2]), None


def _q5_1(b: np.ndarray) -> Unpacked:
    return _five_bits(b, 4).astype(np.int8), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q8_0(b: np.ndarray) -> Unpacked:
    return np.ascontiguousarray(b[:, 2:]).view(np.int8), _f16(b[:, :2]), None


def _q4_k(b: np.ndarray) -> Unpacked:
    sc, mins = _k_scales(b[:, 4:16])
    return _nibbles(b[:, 16:], 64), _f16(b[:, :2]) * sc, -(_f16(b[:, 2:4]) * mins)


def _q5_k(b: np.ndarray) -> Unpacked:
    n = b.shape[0]
    sc, mins = _k_scales(b[:, 4:16])
    qh = b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    q = _nibbles(b[:, 48:], 64) | ((qh & np.uint8(1)).reshape(n, QK_K) << np.uint8(4))
    return q.astype(np.int8), _f16(b[:, :2]) * sc, -(_f16(b[:, 2:4]) * mins)


def _q6_k(b: np.ndarray) -> Unpacked:
    n = b.shape[0]
    ql = _nibbles(b[:, :128], 128)  # per half: 64 low nibbles, then 64 high
    qh = b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = ql | ((qh & np.uint8(3)).reshape(n, QK_K) << np.uint8(4))
    scales = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    return q.astype(np.int8) - np.int8(32), _f16(b[:, 208:210]) * scales, None


def _mxfp4(b: np.ndarray) -> Unpacked:
    e = b[:, :1].astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))  # 2^(e - 128)
    return _nibbles(b[:, 1:], 32), bits.view(np.float32), None


#: GGUF type name -> (Sonar format, elements per block, bytes per block, group, unpacker)
BLOCK_TYPES: dict[str, tuple[str, int, int, int, Callable[[np.ndarray], Unpacked]]] = {
    "Q4_0": ("int4", 32, 18, 32, _q4_0),
    "Q4_1": ("int4", 32, 20, 32, _q4_1),
    "Q5_0": ("int8", 32, 22, 32, _q5_0),
    "Q5_1": ("int8", 32, 24, 32, _q5_1),
    "Q8_0": ("int8", 32, 34, 32, _q8_0),
    "Q4_K": ("int4", QK_K, 144, 32, _q4_k),
    "Q5_K": ("int8", QK_K, 176, 32, _q5_k),
    "Q6_K": ("int8", QK_K, 210, 16, _q6_k),
    "MXFP4": ("mxfp4", 32, 17, 32, _mxfp4),
}


def served_quantized(type_name: str) -> bool:
    return type_name in BLOCK_TYPES


def block_weight(type_name: str, data: np.ndarray, rows: int, cols: int) -> QuantizedWeight:
    """A ``[rows, cols]`` GGUF tensor of a type in `BLOCK_TYPES` (its raw bytes, any shape) as a
    `QuantizedWeight`."""
    fmt, block, size, group, unpack = BLOCK_TYPES[type_name]
    if cols % block:
        raise ValueError(f"a {type_name} row of {cols} values is not a whole number of {block}-value blocks")
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(rows * cols // block, size)
    values, scales, offsets = unpack(blocks)
    if fmt == "int4":
        values = values.astype(np.uint8)

    def matrix(a: np.ndarray, width: int) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a).reshape(rows, width))

    groups = cols // group
    return QuantizedWeight(
        fmt,  # type: ignore[arg-type]
        matrix(values, cols),
        matrix(scales.astype(np.float32), groups),
        None if offsets is None else matrix(offsets.astype(np.float32), groups),
        group,
    )
