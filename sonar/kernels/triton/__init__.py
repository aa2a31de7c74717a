"""Triton kernels, each beside its torch reference (``sonar.kernels.reference`` and
``sonar.kernels.attention``). Importing this package needs ``triton``; callers that must work
without it go through :mod:`sonar.kernels.ops`. Under ``TRITON_INTERPRET=1`` (set before this
package is imported) the kernels run on CPU tensors, which is how the CPU tests check them.
"""

from sonar.kernels.triton.block_copy import copy_blocks
from sonar.kernels.triton.decode_attention import paged_decode_attention
from sonar.kernels.triton.kv_cache_write import write_kv_cache
from sonar.kernels.triton.lora import LORA_MAX_SPLITS, lora_add
from sonar.kernels.triton.paged_attention import paged_attention
from sonar.kernels.triton.prefill_attention import paged_prefill_attention
from sonar.kernels.triton.rms_norm import rms_norm
from sonar.kernels.triton.silu_and_mul import silu_and_mul

__all__ = [
    "LORA_MAX_SPLITS",
    "copy_blocks",
    "lora_add",
    "paged_attention",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "silu_and_mul",
    "write_kv_cache",
]
