"""Prepacked linear layers (Sonar's bf16 layout or oneDNN's) against ``F.linear``, the native
kernel serving every row count (on AMX tiles from `linear.amx_rows` rows), and the module swap that
installs them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sonar.kernels import linear, native
from sonar.kernels.linear import PackedLinear, can_pack, native_shape, pack_native, prepack_linears

pytestmark = pytest.mark.usefixtures("one_thread")

#: Whether this CPU packs bfloat16 weights at all (Sonar's kernel needs AVX512-BF16, oneDNN's
#: AVX512-BW/VL/DQ or AVX-NE-CONVERT); where it cannot, `prepack_linears` leaves them to ``F.linear``.
BF16_PACKS = can_pack(torch.empty(8, 8, dtype=torch.bfloat16))


def _prepacked(linear: nn.Linear, batch_hint: int) -> nn.Module:
    """The layer `prepack_linears` installs for `linear`: a `PackedLinear` where this CPU packs
    bfloat16, the ``nn.Linear`` itself where it does not."""
    holder = nn.Sequential(linear)
    assert prepack_linears(holder, batch_hint) == int(BF16_PACKS)
    assert isinstance(holder[0], PackedLinear) == BF16_PACKS
    return holder[0]


@pytest.mark.parametrize("out_features", [7, 16, 40])
def test_native_layout_is_16_column_tiles_along_pairs_of_k(out_features: int) -> None:
    gen = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, 12, generator=gen).to(torch.bfloat16)
    padded = torch.cat((weight, weight.new_zeros(-out_features % 16, 12)))  # the last tile's missing columns
    expected = padded.reshape(-1, 16, 6, 2).permute(0, 2, 1, 3)  # [tile, k pair, column, k in pair]
    assert native_shape(out_features, 12) == expected.shape
    assert torch.equal(pack_native(weight), expected)
    into = torch.full(expected.shape, float("nan"), dtype=torch.bfloat16)
    assert pack_native(weight, into) is into and torch.equal(into, expected)
    transposed = weight.t().contiguous().t()  # not contiguous: packs the same
    assert torch.equal(pack_native(transposed), expected)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 16, 77])
def test_packed_equals_f_linear(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    linear = nn.Linear(96, 40, bias=bias, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, 96, generator=gen))
        if bias:
            linear.bias.copy_(torch.randn(40, generator=gen))
    x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
    packed = _prepacked(linear, batch_hint=16)
    got = packed(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 40)
    torch.testing.assert_close(got.float(), F.linear(x, linear.weight, linear.bias).float(), atol=0.06, rtol=1e-2)


def test_other_inputs_take_f_linear() -> None:
    linear = nn.Linear(8, 4, dtype=torch.bfloat16)
    packed = _prepacked(linear, batch_hint=1)
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16)  # not a flat batch
    torch.testing.assert_close(packed(x), F.linear(x, linear.weight, linear.bias))


def test_prepack_keeps_parameters_and_ties() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(32, 8)
            self.proj = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8, bias=False))
            self.head = nn.Linear(8, 32, bias=False)
            self.head.weight = self.embed.weight

    model = Tied().to(torch.bfloat16)
    names = {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)}
    assert prepack_linears(model) == (3 if BF16_PACKS else 0)
    assert {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)} == names
    assert isinstance(model.head, PackedLinear) == BF16_PACKS and model.head.weight is model.embed.weight
    assert set(model.state_dict()) == {"embed.weight", "proj.0.weight", "proj.0.bias", "proj.1.weight", "head.weight"}


def test_float32_is_left_alone() -> None:
    model = nn.Sequential(nn.Linear(8, 8))
    assert not can_pack(model[0].weight)
    assert prepack_linears(model) == 0 and type(model[0]) is nn.Linear


@pytest.mark.parametrize("rows", [1, 3, 4, 16, 20, 300, linear.ONEDNN_AMX_ROWS])
def test_natively_packed_rows_go_to_the_native_kernel(rows: int) -> None:
    """A natively packed layer runs the native kernel (on a CPU with AMX, its tile path from
    `linear.amx_rows` rows on), within bf16 rounding of ``F.linear``; on AMX, from
    `linear.ONEDNN_AMX_ROWS` rows (prefills) ``F.linear`` itself."""
    gen = torch.Generator().manual_seed(rows)
    layer = nn.Linear(96, 40, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(40, 96, generator=gen))
        layer.bias.copy_(torch.randn(40, generator=gen))
    packed = _prepacked(layer, batch_hint=16)
    x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
    if not isinstance(packed, PackedLinear) or not packed.native_layout:
        assert not linear.can_pack_native(layer.weight)  # no AVX512-BF16: test_packed_equals_f_linear's paths
        assert linear.amx_rows() == 0
        return
    assert (linear.amx_rows() > 0) == native.amx_bf16()
    oned = native.amx_bf16() and rows >= linear.ONEDNN_AMX_ROWS
    assert linear.onednn_serves(rows) == oned
    by_kernel = torch.ops.sonar_cpu.linear_bf16(x, packed.packed, layer.bias, 40)
    assert torch.equal(packed(x), F.linear(x, layer.weight, layer.bias) if oned else by_kernel)
    want = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    assert ((by_kernel.float() - want).abs() <= want.abs() * 2**-8 + 1e-5).all()
