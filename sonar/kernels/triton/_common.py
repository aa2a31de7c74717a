"""Helpers shared by the Triton kernels: interpreter detection, block sizes, FP8 rounding.

Two facts about Triton's CPU interpreter (``TRITON_INTERPRET=1``, Triton 3.6) shape the kernels:
it keeps bfloat16 values as raw 16-bit integers, so arithmetic and ``tl.dot`` on bf16 operands
are wrong there (every kernel converts loads to float32 before arithmetic, and the attention
kernels run their dots in float32 under the interpreter); and its float32 -> float8 conversion
neither saturates nor rounds to nearest-even, so :func:`round_to_e4m3` does both first and the
conversion itself is exact on every backend.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

FP8_E4M3_MAX = 448.0


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether attention dots run in float32: always on the interpreter (see the module doc),
    and for float32 inputs anywhere (then with ``input_precision="ieee"``, not TF32)."""
    return interpreting() or dtype == torch.float32


def check_last_dim_contiguous(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"the last dimension must be contiguous, got strides {t.stride()}")


def check_fp8_supported(t: torch.Tensor) -> None:
    """Triton's float8 e4m3 type needs compute capability 8.9 (Ada, Hopper) or newer."""
    if t.is_cuda and torch.cuda.get_device_capability(t.device) < (8, 9):
        name = torch.cuda.get_device_name(t.device)
        raise NotImplementedError(f"an fp8 KV cache needs a GPU of compute capability 8.9 or newer, not {name}")


@contextlib.contextmanager
def device_of(t: torch.Tensor) -> Iterator[None]:
    """Launch on ``t``'s GPU (Triton launches on the current device)."""
    if t.is_cuda:
        with torch.cuda.device(t.device):
            yield
    else:
        yield


@triton.jit
def round_to_e4m3(x):
    """Round float32 ``x`` to the nearest float8 e4m3fn value (ties to even, saturating at
    +-448), still as float32: a later ``.to(tl.float8e4nv)`` is then exact everywhere."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    # normal e4m3 numbers (|x| >= 2**-6): keep 3 of float32's 23 mantissa bits, ties to even
    bits = x.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & -0x100000).to(tl.float32, bitcast=True)
    # subnormal e4m3 numbers are multiples of 2**-9: adding 1.5 * 2**14 to |x| rounds it to that
    # grid; the sign goes back on afterwards so that small negatives become -0.0, as in torch
    magnitude = ((tl.abs(x) + 24576.0) - 24576.0).to(tl.int32, bitcast=True)
    subnormal = (magnitude | (bits & -0x80000000)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def softcap_scores(s, cap):
    """Logit soft-capping ``cap * tanh(s / cap)`` of scores in any one unit (the attention
    kernels pass both in base-2 units: ``s * log2(e)`` and ``cap * log2(e)``). Triton has no
    portable tanh: ``tanh(y) = 1 - 2 / (exp(2 y) + 1)``, which saturates to +-1 for large ``|y|``."""
    y = s / cap
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0))
