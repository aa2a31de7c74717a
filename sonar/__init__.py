"""Sonar: an LLM inference server built from supervised actors."""

from sonar.engine.client import LLM, CompletionOutput, RequestOutput, StreamDelta, open
from sonar.errors import EngineDeadError, InvalidRequestError, SonarError
from sonar.sampling_params import SamplingParams, SamplingParamsError

__version__ = "0.1.0"

__all__ = [
    "LLM", "CompletionOutput", "EngineDeadError", "InvalidRequestError", "RequestOutput", "SamplingParams",
    "SamplingParamsError", "SonarError", "StreamDelta", "__version__", "open",
]
