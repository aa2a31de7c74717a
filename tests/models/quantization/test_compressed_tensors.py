"""compressed-tensors layers in the three formats Sonar reads, written in the test from the
format's packing (signed values stored unsigned, eight to an int32), read back exactly."""

from __future__ import annotations

import pytest
import torch

from sonar.kernels.quant import dequantize
from sonar.models.errors import ModelLoadError
from sonar.models.quantization.compressed_tensors import CompressedTensors
from tests.models.quantization.formats import ct_config, ct_int8, ct_packed, ct_weights, fp8_block, fp8_scaled

N, K = 64, 256


def _weight(seed: int = 0) -> torch.Tensor:
    return torch.randn(N, K, generator=torch.Generator().manual_seed(seed))


def _method(fmt: str, weights: dict, ignore: list[str] | None = None, acts: dict | None = None) -> CompressedTensors:
    return CompressedTensors.from_config(ct_config(fmt, weights, ignore or ["lm_head"], acts))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 128, None])
@pytest.mark.parametrize("sym", [True, False])
def test_pack_quantized_dequantizes_to_the_format_formula(bits: int, group: int | None, sym: bool) -> None:
    tensors, ref = ct_packed(_weight(bits), bits, group, sym)
    strategy = "channel" if group is None else "group"
    qw = _method("pack-quantized", ct_weights(bits, "int", strategy, sym, group)).convert("m", tensors)
    assert qw.format == ("int4" if bits == 4 else "int8")
    assert qw.group == (group or K)
    # bfloat16 scales times small integers are exact in float32: equal, not close
    assert torch.equal(dequantize(qw), ref)


def test_pack_quantized_act_order() -> None:
    tensors, ref = ct_packed(_weight(5), 4, 64, True, desc_act=True)
    qw = _method("pack-quantized", ct_weights(4, "int", "group", True, 64)).convert("m", tensors)
    assert qw.perm is not None
    assert torch.equal(dequantize(qw), ref)


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
def test_float_quantized(strategy: str) -> None:
    w = _weight(7)
    if strategy == "block":
        tensors, ref = fp8_block(w, (32, 64))
        tensors["weight_scale"] = tensors.pop("weight_scale_inv")
    else:
        tensors, ref = fp8_scaled(w, per_row=strategy == "channel")
    tensors["input_scale"] = torch.tensor([0.05])
    acts = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    method = _method(
        "float-quantized", ct_weights(8, "float", strategy, block=[32, 64] if strategy == "block" else None), acts=acts
    )
    qw = method.convert("m", tensors)
    assert qw.format == "fp8"
    assert torch.equal(dequantize(qw), ref)
    with pytest.raises(ModelLoadError, match="m lacks its input_scale tensor"):  # static activations
        method.convert("m", {k: v for k, v in tensors.items() if k != "input_scale"})


@pytest.mark.parametrize("sym", [True, False])
def test_int_quantized(sym: bool) -> None:
    tensors, ref = ct_int8(_weight(9), sym)
    acts = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}
    qw = _method("int-quantized", ct_weights(8, "int", "channel", sym), acts=acts).convert("m", tensors)
    assert qw.format == "int8" and (qw.offsets is None) == sym
    assert torch.equal(dequantize(qw), ref)


def test_ignore_and_targets() -> None:
    config = ct_config("pack-quantized", ct_weights(4, "int", "group", True, 32), ["lm_head", "re:.*mlp\\.down_proj$"])
    config["config_groups"]["group_1"] = {
        "targets": ["re:.*self_attn.*"],
        "weights": ct_weights(8, "int", "channel", True),
        "format": "int-quantized",
    }
    config["config_groups"]["group_0"]["targets"] = ["re:.*mlp.*"]
    method = CompressedTensors.from_config(config)
    assert method.scheme_for("model.layers.0.mlp.up_proj").format == "pack-quantized"
    assert method.scheme_for("model.layers.0.self_attn.k_proj").format == "int-quantized"
    assert method.scheme_for("model.layers.0.mlp.down_proj") is None
    assert not method.quantized("lm_head", {"weight"})
    with pytest.raises(ModelLoadError, match="lm_head is stored quantized, but the compressed-tensors config"):
        method.quantized("lm_head", {"weight", "weight_scale"})


def _config_with(**changes: object) -> dict:
    config = ct_config("pack-quantized", ct_weights(4, "int", "group", True, 128), ["lm_head"])
    for key, value in changes.items():
        if key.startswith("weights_"):
            config["config_groups"]["group_0"]["weights"][key.removeprefix("weights_")] = value
        else:
            config[key] = value
    return config


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"format": "nvfp4-pack-quantized"}, "format 'nvfp4-pack-quantized' is not supported"),
        ({"format": "marlin-24"}, "format 'marlin-24' is not supported"),
        ({"format": "naive-quantized"}, "format 'naive-quantized' is not supported"),
        ({"weights_num_bits": 2}, "pack-quantized with 2-bit int weights is not supported"),
        ({"weights_type": "float"}, "pack-quantized with 4-bit float weights"),
        ({"weights_strategy": "tensor"}, "strategy 'tensor' is not supported"),
        ({"weights_group_size": None}, "group strategy needs a positive group_size"),
        ({"sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity format 'sparse-24-bitmask'"),
        ({"kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme is not supported"),
        ({"quantization_status": "frozen"}, "quantization_status 'frozen'"),
        ({"transform_config": {"config_groups": {"R1": {"type": "hadamard"}}}}, "transform_config"),
    ],
)
def test_unsupported_configs_are_refused(changes: dict, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        CompressedTensors.from_config(_config_with(**changes))


def test_group_sizes_that_do_not_fit_the_layer_are_refused() -> None:
    tensors, _ = ct_packed(torch.randn(16, 96), 4, 32, True)
    with pytest.raises(ModelLoadError, match="group_size 64 does not divide its 96 input features"):
        _method("pack-quantized", ct_weights(4, "int", "group", True, 64)).convert("m", tensors)
    with pytest.raises(ModelLoadError, match="weight_scale holds 3 scales per row; groups of 48 need 2"):
        _method("pack-quantized", ct_weights(4, "int", "group", True, 48)).convert("m", tensors)
