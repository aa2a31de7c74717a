"""The logical layout of quantized weights (`sonar.kernels.quant`): validation, the dequantized
reference, act-order permutations and stacking weights of different formats into one matrix."""

from __future__ import annotations

import pytest
import torch

from sonar.kernels.quant import QuantizationError, QuantizedWeight, dequantize, reference_linear, stack_rows


def _int4(n: int, k: int, group: int, seed: int = 0, offsets: bool = True) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    return QuantizedWeight(
        "int4",
        torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
        torch.rand(n, k // group, generator=g) / 8,
        -torch.rand(n, k // group, generator=g) if offsets else None,
        group,
    )


def _int8(n: int, k: int, group: int, seed: int = 1) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    return QuantizedWeight(
        "int8",
        torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8),
        torch.rand(n, k // group) / 64,
        None,
        group,
    )


def test_dequantize_is_the_formula() -> None:
    qw = _int4(4, 64, 32)
    w = dequantize(qw)
    n, k = 2, 40
    assert w[n, k] == qw.values[n, k].float() * qw.scales[n, k // 32] + qw.offsets[n, k // 32]
    assert dequantize(qw, torch.bfloat16).dtype == torch.bfloat16


def test_perm_undoes_act_order() -> None:
    """The stored columns are sorted by group; `dequantize` puts each back where the input has it,
    and `reference_linear` multiplies the input as given."""
    plain = _int4(8, 64, 16)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(3))
    stored = dequantize(plain)  # column j of storage holds input column perm[j]
    permuted = QuantizedWeight("int4", plain.values, plain.scales, plain.offsets, 16, perm)
    w = dequantize(permuted)
    torch.testing.assert_close(w[:, perm], stored, rtol=0, atol=0)
    x = torch.randn(3, 64)
    torch.testing.assert_close(reference_linear(x, permuted), x[:, perm] @ stored.T)


def test_malformed_weights_are_refused() -> None:
    good = _int4(4, 64, 32)
    with pytest.raises(QuantizationError, match="does not divide"):
        QuantizedWeight("int4", good.values, good.scales, good.offsets, 48)
    with pytest.raises(QuantizationError, match="uint8"):
        QuantizedWeight("int4", good.values.to(torch.int8), good.scales, None, 32)
    with pytest.raises(QuantizationError, match="scales must be float32"):
        QuantizedWeight("int4", good.values, good.scales.half(), None, 32)
    with pytest.raises(QuantizationError, match="unknown quantized format"):
        QuantizedWeight("int3", good.values, good.scales, None, 32)  # type: ignore[arg-type]


def test_stack_rows_keeps_every_value() -> None:
    """q, k and v of one format stack as they are; int4 with int8 and groups of 32 with 16 widen
    (int8, groups of 16) without changing a weight."""
    q, k = _int4(8, 64, 32, seed=1), _int4(4, 64, 32, seed=2, offsets=False)
    same = stack_rows([q, k])
    assert (same.format, same.group) == ("int4", 32)
    torch.testing.assert_close(dequantize(same), torch.cat([dequantize(q), dequantize(k)]), rtol=0, atol=0)
    v = _int8(4, 64, 16)
    mixed = stack_rows([q, k, v])
    assert (mixed.format, mixed.group) == ("int8", 16)
    expected = torch.cat([dequantize(q), dequantize(k), dequantize(v)])
    torch.testing.assert_close(dequantize(mixed), expected, rtol=0, atol=0)


def test_stack_rows_refuses_what_cannot_share_a_matrix() -> None:
    q = _int4(8, 64, 32)
    perm = torch.randperm(64)
    with pytest.raises(QuantizationError, match="permutations"):
        stack_rows([q, QuantizedWeight("int4", q.values, q.scales, q.offsets, 32, perm)])
    fp8 = QuantizedWeight("fp8", torch.zeros(8, 64).to(torch.float8_e4m3fn), torch.ones(8, 1), None, 64)
    with pytest.raises(QuantizationError, match="cannot stack"):
        stack_rows([q, fp8])
    with pytest.raises(QuantizationError, match="input columns"):
        stack_rows([q, _int4(8, 32, 32)])
