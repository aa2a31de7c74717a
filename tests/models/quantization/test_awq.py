"""AWQ (GEMM) layers quantized and packed in the test with AutoAWQ's interleaved order read back
exactly: ``(q - z) * s``."""

from __future__ import annotations

import pytest
import torch

from sonar.kernels.quant import dequantize
from sonar.models.errors import ModelLoadError
from sonar.models.quantization.awq import AWQ
from tests.models.quantization.formats import awq, awq_config


@pytest.mark.parametrize("group", [32, 64, 128, -1])
def test_dequantizes_to_the_format_formula(group: int) -> None:
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(group + 2))
    tensors, ref = awq(w, group)
    qw = AWQ.from_config(awq_config(group)).convert("m", tensors)
    assert qw.format == "int4" and qw.perm is None
    assert torch.equal(dequantize(qw), ref)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"version": "gemv"}, "AWQ version 'gemv'"),
        ({"version": "marlin"}, "AWQ version 'marlin'"),
        ({"version": None, "checkpoint_format": "gemv_fast"}, "AWQ version 'gemv_fast'"),
        ({"bits": 8}, "AWQ bits 8"),
        ({"group_size": 256}, "AWQ group_size 256"),
        ({"zero_point": False}, "zero_point false"),
    ],
)
def test_unsupported_configs_are_refused(change: dict, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        AWQ.from_config({**awq_config(128), **change})


def test_a_group_size_that_does_not_divide_the_layer_is_refused() -> None:
    tensors, _ = awq(torch.randn(16, 96), -1)
    with pytest.raises(ModelLoadError, match="group_size 64 does not divide its 96 input features"):
        AWQ.from_config(awq_config(64)).convert("layer", tensors)


def test_modules_to_not_convert() -> None:
    method = AWQ.from_config({**awq_config(128), "modules_to_not_convert": ["mlp.down_proj"]})
    with pytest.raises(ModelLoadError, match="model.layers.3.mlp.down_proj is in modules_to_not_convert"):
        method.quantized("model.layers.3.mlp.down_proj", {"qweight", "qzeros", "scales"})
