"""Sonar: an LLM inference server built from supervised actors."""

from sonar.sampling_params import SamplingParams, SamplingParamsError

__version__ = "0.1.0"

__all__ = ["SamplingParams", "SamplingParamsError", "__version__"]
