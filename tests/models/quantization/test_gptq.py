"""GPTQ layers quantized in the test (min-max, GPTQ's packing, act-order from a random column
order) read back exactly: the logical layout dequantizes to the format's ``(q - z) * s``."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from sonar.kernels.quant import dequantize
from sonar.models.errors import ModelLoadError
from sonar.models.quantization.gptq import GPTQ
from tests.models.quantization.formats import gptq, gptq_config

N, K = 96, 256


def _weight(seed: int = 0) -> torch.Tensor:
    return torch.randn(N, K, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128, -1])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("desc_act", [False, True])
@pytest.mark.parametrize("v1", [True, False])
def test_dequantizes_to_the_format_formula(bits: int, group: int, sym: bool, desc_act: bool, v1: bool) -> None:
    tensors, ref = gptq(_weight(), bits, group, sym, desc_act, v1)
    qw = GPTQ.from_config(gptq_config(bits, group, sym, desc_act, v1)).convert("m", tensors)
    assert qw.format == ("int4" if bits == 4 else "int8")
    assert qw.group == (K if group == -1 else group)
    assert (qw.perm is not None) == (desc_act and group != -1)  # one group: nothing to reorder
    assert torch.equal(dequantize(qw), ref)


def test_the_v1_zero_offset_is_read() -> None:
    """The same tensors read as gptq_v2 are off by one zero step per group."""
    tensors, ref = gptq(_weight(), 4, 64, True, False, v1=True)
    v2 = GPTQ.from_config(gptq_config(4, 64, True, False, v1=False)).convert("m", tensors)
    step = tensors["scales"].float().T.repeat_interleave(64, dim=1)
    torch.testing.assert_close(dequantize(v2), ref + step)


def test_layer_output_matches_the_dequantized_weight() -> None:
    tensors, ref = gptq(_weight(1), 4, 32, False, True, v1=True)
    qw = GPTQ.from_config(gptq_config(4, 32, False, True, True)).convert("m", tensors)
    x = torch.randn(5, K)
    stored = dequantize(replace(qw, perm=None))  # the columns sorted by group, as a kernel reads them
    # the layer's contract: x[:, perm] against the stored columns (float32, summed in another order)
    torch.testing.assert_close(x[:, qw.perm] @ stored.T, x @ ref.T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"bits": 3}, "GPTQ bits 3"),
        ({"bits": 2}, "GPTQ bits 2"),
        ({"group_size": 16}, "GPTQ group_size 16"),
        ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
        ({"is_marlin_format": True}, "checkpoint_format 'marlin'"),
        ({"dynamic": {"-:.*down_proj": {}}}, "quantization_config.dynamic"),
        ({"pack_dtype": "int16"}, "pack_dtype 'int16'"),
    ],
)
def test_unsupported_configs_are_refused(change: dict, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        GPTQ.from_config({**gptq_config(4, 128, True, False, True), **change})


def test_a_group_size_that_does_not_divide_the_layer_is_refused() -> None:
    w = torch.randn(32, 96)
    tensors, _ = gptq(w, 4, -1, True, False, True)  # one group of 96, read as groups of 64
    with pytest.raises(ModelLoadError, match="group_size 64 does not divide its 96 input features"):
        GPTQ.from_config(gptq_config(4, 64, True, False, True)).convert("layer", tensors)


def test_unequal_act_order_groups_are_refused() -> None:
    tensors, _ = gptq(_weight(), 4, 64, True, True, True)
    tensors["g_idx"] = tensors["g_idx"].clone()
    tensors["g_idx"][tensors["g_idx"] == 1] = 0
    with pytest.raises(ModelLoadError, match="does not assign 64 input columns to each of its 4 groups"):
        GPTQ.from_config(gptq_config(4, 64, True, True, True)).convert("layer", tensors)


def test_missing_and_misshapen_parts_are_named() -> None:
    tensors, _ = gptq(_weight(), 4, 64, True, False, True)
    method = GPTQ.from_config(gptq_config(4, 64, True, False, True))
    with pytest.raises(ModelLoadError, match="layer lacks its qzeros tensor"):
        method.convert("layer", {k: v for k, v in tensors.items() if k != "qzeros"})
    with pytest.raises(ModelLoadError, match=r"layer.scales has shape \(4, 95\), expected \(4, 96\)"):
        method.convert("layer", {**tensors, "scales": tensors["scales"][:, :95]})


def test_modules_to_not_convert() -> None:
    method = GPTQ.from_config({**gptq_config(4, 64, True, False, True), "modules_to_not_convert": ["lm_head"]})
    assert not method.quantized("lm_head", {"scales"})
    assert method.quantized("model.layers.0.mlp.up_proj", {"qweight", "qzeros", "scales"})
    with pytest.raises(ModelLoadError, match="lm_head is in modules_to_not_convert"):
        method.quantized("lm_head", {"qweight", "qzeros", "scales"})
