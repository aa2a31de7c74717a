"""FP8 layers: block scales (the last blocks partial), per-tensor scales with static input
scales, and quantization at load (`quantize_dynamic_fp8`)."""

from __future__ import annotations

import pytest
import torch

from sonar.kernels.quant import dequantize
from sonar.models.errors import ModelLoadError
from sonar.models.quantization.fp8 import FP8, DynamicFP8, quantize_dynamic_fp8
from tests.models.quantization.formats import fp8_block, fp8_config, fp8_scaled


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "shape, block, group",
    [((256, 256), (128, 128), 128), ((100, 200), (64, 128), 8), ((96, 64), (128, 128), 64), ((64, 96), (16, 32), 32)],
)
def test_block_scales_dequantize_to_the_format_formula(shape: tuple, block: tuple, group: int) -> None:
    """``float(q) * s[n // bn, k // bk]`` bit for bit (the same float32 product); partial last
    blocks become smaller groups (``gcd(bk, K)``)."""
    tensors, ref = fp8_block(_weight(*shape), block)
    qw = FP8.from_config(fp8_config(block)).convert("m", tensors)
    assert qw.format == "fp8" and qw.group == group
    assert torch.equal(dequantize(qw), ref)


@pytest.mark.parametrize("per_row", [False, True])
def test_scaled_weights_with_static_input_scales(per_row: bool) -> None:
    tensors, ref = fp8_scaled(_weight(48, 64), per_row)
    tensors["input_scale"] = torch.tensor(0.02)
    qw = FP8.from_config(fp8_config(None, static=True)).convert("m", tensors)
    assert qw.group == 64
    assert torch.equal(dequantize(qw), ref)


def test_static_scheme_needs_sane_input_scales() -> None:
    tensors, _ = fp8_scaled(_weight(8, 16), False)
    method = FP8.from_config(fp8_config(None, static=True))
    with pytest.raises(ModelLoadError, match="m lacks its input_scale tensor"):
        method.convert("m", tensors)
    with pytest.raises(ModelLoadError, match="m.input_scale must hold positive finite scales"):
        method.convert("m", {**tensors, "input_scale": torch.tensor(float("nan"))})


def test_a_weight_that_is_not_fp8_is_refused() -> None:
    tensors, _ = fp8_block(_weight(16, 16), (8, 8))
    with pytest.raises(ModelLoadError, match="m.weight is torch.bfloat16"):
        FP8.from_config(fp8_config((8, 8))).convert(
            "m", {**tensors, "weight": torch.zeros(16, 16, dtype=torch.bfloat16)}
        )
    with pytest.raises(ModelLoadError, match=r"m.weight_scale_inv has shape \(2, 2\), expected \(2, 4\)"):
        FP8.from_config(fp8_config((8, 4))).convert("m", tensors)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"fmt": "e5m2"}, "FP8 fmt 'e5m2'"),
        ({"activation_scheme": "per_token"}, "activation_scheme 'per_token'"),
        ({"weight_block_size": [128]}, "weight_block_size"),
        ({"weight_block_size": [128, 128], "activation_scheme": "static"}, "static activation_scheme"),
    ],
)
def test_unsupported_configs_are_refused(change: dict, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        FP8.from_config({**fp8_config(None), **change})


def test_ignored_layers_stored_fp8_contradict_the_config() -> None:
    method = FP8.from_config({**fp8_config((128, 128)), "modules_to_not_convert": ["lm_head"]})
    assert not method.quantized("lm_head", {"weight"})
    with pytest.raises(ModelLoadError, match="lm_head is in modules_to_not_convert"):
        method.quantized("lm_head", {"weight", "weight_scale_inv"})


def test_dynamic_quantization_per_output_row() -> None:
    w = _weight(64, 96, seed=3) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different size
    w[5] = 0
    qw = quantize_dynamic_fp8(w.to(torch.bfloat16))
    assert qw.format == "fp8" and qw.group == 96 and qw.scales.shape == (64, 1)
    amax = w.to(torch.bfloat16).float().abs().amax(1)
    # each row's largest weight lands on the format's largest value (448), except the zero row
    assert torch.equal(qw.values.float().abs().amax(1)[amax > 0], torch.full((63,), 448.0))
    assert torch.equal(dequantize(qw)[5], torch.zeros(96))
    # e4m3 keeps 3 mantissa bits: a relative error of at most 2^-4, plus half the smallest
    # subnormal step (2^-10 of the row's scale) near zero
    err = (dequantize(qw) - w.to(torch.bfloat16).float()).abs()
    bound = w.to(torch.bfloat16).float().abs() / 16 + qw.scales * 2.0**-10
    assert bool((err <= bound).all())


def test_dynamic_method_quantizes_decoder_linears_only() -> None:
    method = DynamicFP8()
    assert method.quantized("model.layers.0.self_attn.q_proj", {"weight"})
    assert method.quantized("model.layers.11.mlp.down_proj", {"weight"})
    assert not method.quantized("lm_head", {"weight"})
    assert not method.quantized("model.embed_tokens", {"weight"})
    assert not method.quantized("model.layers.0.input_layernorm", {"weight"})
    with pytest.raises(ModelLoadError, match="holds non-finite values"):
        method.convert("m", {"weight": torch.tensor([[1.0, float("inf")]])})
