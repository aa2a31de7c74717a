"""Unpacking int32 words inverts the formats' packers (fields in the sign bit included)."""

from __future__ import annotations

import pytest
import torch

from sonar.models.quantization.packing import awq_columns, unpack_int32
from tests.models.quantization.formats import AWQ_PACK_ORDER, pack_int32


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_unpack_inverts_pack(bits: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(bits + dim)
    fields = torch.randint(0, 2**bits, (16, 24), generator=gen)
    fields[0] = 2**bits - 1  # every field set: the words' sign bit too
    packed = pack_int32(fields, bits, dim)
    assert packed.dtype == torch.int32
    assert packed.shape[dim] == fields.shape[dim] * bits // 32
    assert torch.equal(unpack_int32(packed, bits, dim), fields.to(torch.int32))


def test_first_field_is_lowest_bits() -> None:
    word = torch.tensor([[0x76543210]], dtype=torch.int32)
    assert unpack_int32(word, 4, dim=1).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert unpack_int32(word, 8, dim=0).flatten().tolist() == [0x10, 0x32, 0x54, 0x76]


def test_awq_columns_undo_the_interleaved_order() -> None:
    columns = torch.arange(16).view(1, 16)
    order = torch.arange(16).view(-1, 8)[:, list(AWQ_PACK_ORDER)].reshape(-1)
    packed = pack_int32(columns[:, order], 4, dim=1)
    assert torch.equal(awq_columns(unpack_int32(packed, 4, dim=1)), columns.to(torch.int32))
