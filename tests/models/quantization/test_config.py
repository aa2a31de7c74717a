"""`checkpoint_method`: the method from ``quantization_config``, reconciled with ``--quantization``;
what Sonar does not serve is a ModelLoadError naming it."""

from __future__ import annotations

import pytest

from sonar.models.errors import ModelLoadError
from sonar.models.quantization import checkpoint_method
from sonar.models.quantization.awq import AWQ
from sonar.models.quantization.compressed_tensors import CompressedTensors
from sonar.models.quantization.fp8 import FP8, DynamicFP8
from sonar.models.quantization.gptq import GPTQ
from tests.models.quantization.formats import awq_config, ct_config, ct_weights, fp8_config, gptq_config

PLAIN = {"architectures": ["LlamaForCausalLM"]}


def _with(qc: dict) -> dict:
    return {**PLAIN, "quantization_config": qc}


def test_an_unquantized_checkpoint_has_no_method() -> None:
    assert checkpoint_method(PLAIN, None) is None


@pytest.mark.parametrize(
    "qc, cls",
    [
        (gptq_config(4, 128, True, True, True), GPTQ),
        (awq_config(128), AWQ),
        (fp8_config((128, 128)), FP8),
        (ct_config("pack-quantized", ct_weights(4, "int", "group", True, 128), ["lm_head"]), CompressedTensors),
    ],
)
def test_the_checkpoint_declares_the_method(qc: dict, cls: type) -> None:
    method = checkpoint_method(_with(qc), None)
    assert isinstance(method, cls)
    assert isinstance(checkpoint_method(_with(qc), method.name), cls)  # asking for it changes nothing


def test_fp8_requested_for_a_plain_checkpoint_quantizes_at_load() -> None:
    assert isinstance(checkpoint_method(PLAIN, "fp8"), DynamicFP8)


def test_the_older_compression_config_key() -> None:
    qc = ct_config("float-quantized", ct_weights(8, "float", "channel"), [])
    assert isinstance(checkpoint_method({**PLAIN, "compression_config": qc}, None), CompressedTensors)


@pytest.mark.parametrize(
    "config, requested, message",
    [
        (PLAIN, "gptq", "--quantization gptq: the checkpoint is not quantized"),
        (
            _with(gptq_config(4, 128, True, False, True)),
            "awq",
            "--quantization awq contradicts .*quantization_config \\(gptq\\)",
        ),
        (_with(awq_config(128)), "fp8", "--quantization fp8 contradicts .*\\(awq\\)"),
        (PLAIN, "bitsandbytes", "--quantization: quantization method 'bitsandbytes' is not supported"),
        (PLAIN, "gptq_marlin", "'gptq_marlin' is not supported \\(Marlin"),
        (PLAIN, "int3", "'int3' is not supported; Sonar serves fp8, gptq, awq, compressed-tensors"),
        (
            _with({"quant_method": "bitsandbytes", "load_in_4bit": True}),
            None,
            "checkpoint's quantization method 'bitsandbytes'",
        ),
        (_with({"quant_method": "hqq"}), None, "'hqq' is not supported; Sonar serves"),
        (_with({"bits": 4}), None, "names no quant_method"),
        (_with(["gptq"]), None, "must be an object"),
    ],
)
def test_what_is_not_served_is_refused(config: dict, requested: str | None, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        checkpoint_method(config, requested)
