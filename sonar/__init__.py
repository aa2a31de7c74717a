"""Sonar: an LLM inference server built from supervised actors.

The public names are imported on first use, so `python -m sonar actor` and `sonar serve --help`
start without loading torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "open": "sonar.engine.client",
    "LLM": "sonar.engine.llm",
    "CompletionOutput": "sonar.engine.llm",
    "RequestOutput": "sonar.engine.llm",
    "StreamDelta": "sonar.engine.llm",
    "EngineDeadError": "sonar.errors",
    "InvalidRequestError": "sonar.errors",
    "RequestQuarantinedError": "sonar.errors",
    "SamplingFailedError": "sonar.errors",
    "ServerOverloadedError": "sonar.errors",
    "SonarError": "sonar.errors",
    "SamplingParams": "sonar.sampling_params",
    "SamplingParamsError": "sonar.sampling_params",
    "StructuredOutputsParams": "sonar.sampling_params",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sonar' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
