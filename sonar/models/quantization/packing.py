"""Integer fields packed into int32 words, as the GPTQ, AWQ and compressed-tensors formats store
their weights and zero points.

Every format packs ``32 // bits`` unsigned fields into one int32, the first field in the lowest
bits; they differ in the axis the fields run along (GPTQ's ``qweight`` along the input axis, the
others along the output axis) and, for AWQ, in the order of the fields inside a word.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: AWQ's GEMM layout puts logical column ``8c + j`` of a word's eight into field ``AWQ_FIELD[j]``
#: (its packer writes columns 0, 2, 4, 6, 1, 3, 5, 7 into fields 0..7, an order its kernel unpacks
#: cheaply).
AWQ_FIELD = (0, 4, 1, 5, 2, 6, 3, 7)


def unpack_int32(packed: Tensor, bits: int, dim: int) -> Tensor:
    """The unsigned `bits`-bit fields of int32 `packed`, each word spread into ``32 // bits``
    consecutive entries along `dim` (lowest bits first). Returns int32."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    words = packed.to(torch.int32).movedim(dim, -1)
    # an arithmetic shift drags the sign bit along; the mask keeps only the field
    fields = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return fields.reshape(*words.shape[:-1], -1).movedim(-1, dim)


def awq_columns(fields: Tensor) -> Tensor:
    """Fields unpacked along the last axis (`unpack_int32`) put back in AWQ's logical column order."""
    n = fields.shape[-1]
    order = torch.arange(n).view(-1, len(AWQ_FIELD))[:, list(AWQ_FIELD)].reshape(-1)
    return fields[..., order]
