"""The batched LoRA add of `sonar.models.lora.LoRALinear`: each row of a flat batch gets the delta
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


def lora_add(
    y: Tensor,
    x: Tensor,
    a: Tensor,
    b: Tensor,
    rows: Tensor,
    splits: tuple[int, ...],
    b_packed: Tensor | None = None,
) -> None:
    """``y[i] += b[s] @ (a[s] @ x[i])`` per sub-projection for each row ``i`` with slot
    ``s = rows[i] >= 0``; ``a`` ``[S, len(splits) R, in]``, ``b`` ``[S, sum(splits), R]``.
    `b_packed`: `pack_b` of the same ``b``, which the native kernel then reads instead of packing
    ``b`` itself (the other paths read ``b``)."""
    if x.dtype == y.dtype == a.dtype == b.dtype:
        if ops.use_triton(y, x, a, b, rows):
            from sonar.kernels import triton as kernels  # importable: use_triton checked it

            if len(splits) <= kernels.LORA_MAX_SPLITS:
                kernels.lora_add(y, x, a, b, rows, splits)
                return
        elif ops.use_native(y, x, a, b) and rows.device.type == "cpu" and _contiguous(y, x, a, b, rows):
            torch.ops.sonar_cpu.lora_add(y, x, a, b, rows, list(splits), b_packed)
            return
    reference.lora_add(y, x, a, b, rows, splits)


def packs_b(b: Tensor) -> bool:
    """Whether the native kernel reads `b` packed (`pack_b`): float32 or bfloat16 on the CPU,
    the kernels built."""
    return b.dtype in (torch.float32, torch.bfloat16) and ops.use_native(b)


def pack_b(b: Tensor, splits: tuple[int, ...]) -> Tensor:
    """``b`` ``[S, sum(splits), R]`` (float32 or bfloat16, CPU) in the layout the native expand
    reads (``sonar_cpu::lora_pack_b``): each sub-projection's columns in tiles of 16, float32 as
    ``[S, tiles, R, 16]`` (lane ``c`` of step ``r``: ``b[s, o + c, r]``), bfloat16 as int32 pairs
    ``[S, tiles, ceil(R / 2), 16]`` (lane ``c`` of pair ``p``: ``b[s, o + c, 2p]`` and
    ``b[s, o + c, 2p + 1]``, ``linear_bf16``'s layout). Packed once when an adapter is written, it
    spares every step's expand a transpose of each slot's B."""
    return torch.ops.sonar_cpu.lora_pack_b(b.contiguous(), list(splits))


def _contiguous(*tensors: Tensor) -> bool:
    return all(t.is_contiguous() for t in tensors)


def shrink(x: Tensor, a: Tensor, rows: Tensor) -> Tensor:
    """Per row, ``a[rows[i]] @ x[i]`` in float32 (``[n, a.shape[1]]``; zero for rows -1): the first
    half of `lora_add`, for the layers that exchange it between tensor-parallel ranks
    (``--fully-sharded-loras``, `sonar.models.lora`). A gather of each row's factors: tensor
    parallelism's shapes are a rank's share, and its collectives cost more than this."""
    t = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    valid = (rows >= 0).nonzero().squeeze(1)
    if valid.numel():
        picked = a.index_select(0, rows.index_select(0, valid)).float()
        t[valid] = torch.einsum("nki,ni->nk", picked, x.index_select(0, valid).float())
    return t


def expand(y: Tensor, t: Tensor, b: Tensor, rows: Tensor, splits: tuple[int, ...]) -> None:
    """The second half: per row and sub-projection ``j``, ``y[i, off_j : off_j + splits[j]] +=
    b[rows[i], off_j : ...] @ t[i, j * R : (j + 1) * R]`` (``R = b.shape[2]``; `y` may be a view)."""
    rank = b.shape[2]
    valid = (rows >= 0).nonzero().squeeze(1)
    if not valid.numel():
        return
    picked = b.index_select(0, rows.index_select(0, valid)).float()
    offset = 0
    for j, split in enumerate(splits):
        delta = torch.einsum("nor,nr->no", picked[:, offset : offset + split], t[valid, j * rank : (j + 1) * rank])
        y[valid, offset : offset + split] += delta.to(y.dtype)
        offset += split
