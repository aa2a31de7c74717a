"""`checkpoint_method`: the quantization method a checkpoint's ``config.json`` declares
(``quantization_config``), reconciled with ``--quantization``.
"""

from __future__ import annotations

from typing import Any

from sonar.models.errors import ModelLoadError
from sonar.models.quantization.awq import AWQ
from sonar.models.quantization.compressed_tensors import CompressedTensors
from sonar.models.quantization.fp8 import FP8, DynamicFP8
from sonar.models.quantization.gptq import GPTQ
from sonar.models.quantization.method import Method
from sonar.models.quantization.mxfp4 import MODEL_TYPE, MXFP4

READERS = {
    "fp8": FP8.from_config,
    "gptq": GPTQ.from_config,
    "awq": AWQ.from_config,
    "compressed-tensors": CompressedTensors.from_config,
    "mxfp4": MXFP4.from_config,
}
METHODS = tuple(READERS)
#: Methods other tools write that Sonar knows and does not serve, with why.
REFUSED = {
    "bitsandbytes": "bitsandbytes' 4-bit and 8-bit layouts are not read",
    "gptq_marlin": "Marlin-repacked layouts are not read; GPTQ checkpoints load with gptq",
    "awq_marlin": "Marlin-repacked layouts are not read; AWQ checkpoints load with awq",
    "marlin": "Marlin-repacked layouts are not read",
    "gguf": "GGUF files are loaded by path, not through --quantization",
}


def _refusal(method: str) -> str:
    why = REFUSED.get(method)
    return f"quantization method {method!r} is not supported{f' ({why})' if why else ''}; Sonar serves {', '.join(METHODS)}"


def checkpoint_method(config: dict[str, Any], requested: str | None) -> Method | None:
    """The method to load the checkpoint whose raw ``config.json`` is `config` with, None for
    plain weights.

    `requested` is ``--quantization`` (None: whatever the checkpoint declares). A requested method
    must be the checkpoint's; ``fp8`` on an unquantized checkpoint quantizes its linear layers at
    load (`DynamicFP8`). Anything Sonar cannot serve raises ModelLoadError naming it.
    """
    qc = config.get("quantization_config") or config.get("compression_config")
    if requested is not None and requested not in METHODS:
        raise ModelLoadError(f"--quantization: {_refusal(requested)}")
    if qc is None:
        if requested is None:
            return None
        if requested == "fp8":
            return DynamicFP8()
        raise ModelLoadError(
            f"--quantization {requested}: the checkpoint is not quantized (its config.json has no "
            "quantization_config); only fp8 quantizes a checkpoint as it loads"
        )
    if not isinstance(qc, dict):
        raise ModelLoadError("config.json quantization_config must be an object")
    method = qc.get("quant_method")
    if method == "compressed_tensors" or (method is None and "config_groups" in qc):
        method = "compressed-tensors"
    if method is None:
        raise ModelLoadError("config.json quantization_config names no quant_method")
    if method not in READERS:
        raise ModelLoadError(f"the checkpoint's {_refusal(str(method))}")
    if requested is not None and requested != method:
        raise ModelLoadError(f"--quantization {requested} contradicts the checkpoint's quantization_config ({method})")
    if method == MXFP4.name and config.get("model_type") != MODEL_TYPE:
        raise ModelLoadError(
            f"quantization method 'mxfp4' is served for GPT-OSS ({MODEL_TYPE}) checkpoints' experts only, "
            f"not for model_type {config.get('model_type')!r}"
        )
    return READERS[method](qc)
