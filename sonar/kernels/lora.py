"""The batched LoRA add of `sonar.lora.layers.LoRALinear`: each row of a flat batch gets the delta
of its own adapter slot (or none), all slots in one call.

``lora_add(y, x, a, b, rows, splits)`` updates ``y`` in place (the contract, with its rounding:
`sonar.kernels.reference.lora_add`). Dispatch as `sonar.kernels.ops`: the Triton kernels
(`sonar.kernels.triton.lora`: a per-row shrink, then a per-row and column block expand) for CUDA
tensors, the native CPU operator ``sonar_cpu::lora_add`` for contiguous CPU tensors, the torch
reference otherwise — adapters in another dtype than the model (``--lora-dtype``), float64, or more
sub-projections than the Triton kernel takes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sonar.kernels import ops, reference


def lora_add(y: Tensor, x: Tensor, a: Tensor, b: Tensor, rows: Tensor, splits: tuple[int, ...]) -> None:
    """``y[i] += b[s] @ (a[s] @ x[i])`` per sub-projection for each row ``i`` with slot
    ``s = rows[i] >= 0``; ``a`` ``[S, len(splits) R, in]``, ``b`` ``[S, sum(splits), R]``."""
    if x.dtype == y.dtype == a.dtype == b.dtype:
        if ops.use_triton(y, x, a, b, rows):
            from sonar.kernels import triton as kernels  # importable: use_triton checked it

            if len(splits) <= kernels.LORA_MAX_SPLITS:
                kernels.lora_add(y, x, a, b, rows, splits)
                return
        elif ops.use_native(y, x, a, b) and rows.device.type == "cpu" and _contiguous(y, x, a, b, rows):
            torch.ops.sonar_cpu.lora_add(y, x, a, b, rows, list(splits))
            return
    reference.lora_add(y, x, a, b, rows, splits)


def _contiguous(*tensors: Tensor) -> bool:
    return all(t.is_contiguous() for t in tensors)
