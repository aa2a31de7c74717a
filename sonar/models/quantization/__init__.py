"""Quantized checkpoints: the methods Sonar reads (FP8, GPTQ, AWQ, compressed-tensors), each
converting its layers exactly into `sonar.kernels.quant`'s logical layout, and the load."""

from sonar.models.quantization.config import checkpoint_method
from sonar.models.quantization.fp8 import quantize_dynamic_fp8
from sonar.models.quantization.load import load_quantized_checkpoint
from sonar.models.quantization.method import Method

__all__ = ["Method", "checkpoint_method", "load_quantized_checkpoint", "quantize_dynamic_fp8"]
