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


def test_leading_dimensions_are_rows_and_other_inputs_take_f_linear() -> None:
    linear = nn.Linear(8, 4, dtype=torch.bfloat16)
    weight, bias = linear.weight.detach().clone(), linear.bias.detach().clone()
    packed = _prepacked(linear, batch_hint=1)  # its weight given up where packed natively
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16)  # not a flat batch: its rows, packed
    assert torch.equal(packed(x), packed(x.view(6, 8)).view(2, 3, 4))
    torch.testing.assert_close(packed(x), F.linear(x, weight, bias))
    one = torch.randn(8, dtype=torch.bfloat16)  # one vector: F.linear, on the weight unpacked again
    assert torch.equal(packed(one), F.linear(one, weight, bias))


def test_prepack_keeps_parameters_and_ties() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(32, 8)
            self.proj = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8, bias=False))
            self.head = nn.Linear(8, 32, bias=False)
            self.head.weight = self.embed.weight

    model = Tied().to(torch.bfloat16)
    before = {n: (id(p), p.shape, p.dtype) for n, p in model.named_parameters(remove_duplicate=False)}
    assert prepack_linears(model) == (3 if BF16_PACKS else 0)
    after = {n: (id(p), p.shape, p.dtype) for n, p in model.named_parameters(remove_duplicate=False)}
    assert {n: v[1:] for n, v in after.items()} == {n: v[1:] for n, v in before.items()}
    assert isinstance(model.head, PackedLinear) == BF16_PACKS and model.head.weight is model.embed.weight
    assert not model.head.weight.is_meta, "a tied weight is kept: the embedding reads it"
    assert set(model.state_dict()) == {"embed.weight", "proj.0.weight", "proj.0.bias", "proj.1.weight", "head.weight"}
    # the untied weights packed in Sonar's layout give up their memory (not on AMX: oneDNN reads them)
    dropped = BF16_PACKS and model.proj[0].native_layout and not native.amx_bf16()
    for name in ("proj.0.weight", "proj.1.weight"):
        assert dict(model.named_parameters())[name].is_meta == dropped
        assert (after[name][0] == before[name][0]) != dropped
    assert after["proj.0.bias"][0] == before["proj.0.bias"][0]


def test_a_dropped_weight_is_served_and_restored_from_the_packed_copy() -> None:
    gen = torch.Generator().manual_seed(5)
    plain = nn.Sequential(nn.Linear(96, 40), nn.Linear(40, 96, bias=False)).to(torch.bfloat16)
    with torch.no_grad():
        for p in plain.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    weights = [layer.weight.detach().clone() for layer in plain]
    x = torch.randn(5, 96, generator=gen).to(torch.bfloat16)
    model = nn.Sequential(*plain)
    expected = model(x)
    prepack_linears(model)
    if not linear.can_pack_native_dtype() or native.amx_bf16():
        # no native layout (nothing to unpack from), or AMX (oneDNN reads the plain weight): kept
        assert all(torch.equal(layer.weight, w) for layer, w in zip(model, weights))
        return
    assert all(layer.weight.is_meta for layer in model)
    assert torch.equal(model(x), expected)
    # what the kernel does not take is served from the weight unpacked again: the same numbers
    assert torch.equal(model(x.view(1, 5, 96)), expected.view(1, 5, 96))
    with pytest.raises(RuntimeError, match="same dtype"):
        model(x.float())  # as F.linear refuses it
    # a weight update writes into the parameters: inside, each holds its weight again
    with linear.materialized(model):
        assert all(torch.equal(layer.weight, w) for layer, w in zip(model, weights))
        with torch.no_grad():
            model[1].weight.mul_(2)
        model[1].repack()
    assert all(layer.weight.is_meta for layer in model)
    torch.testing.assert_close(model(x).float(), (expected.float() * 2), rtol=1e-2, atol=0.5)
    with pytest.raises(RuntimeError, match="restore_weight first"):
        model[0].repack()


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
