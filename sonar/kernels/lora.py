"""PLACEHOLDER reference until the kernels land."""

from __future__ import annotations

import torch
from torch import Tensor


def lora_add(y: Tensor, x: Tensor, a: Tensor, b: Tensor, rows: Tensor, splits: tuple[int, ...]) -> None:
    rank = b.shape[2]
    for s in rows.unique().tolist():
        if s < 0:
            continue
        sel = (rows == s).nonzero().squeeze(1)
        xs = x.index_select(0, sel).to(a.dtype)
        off = 0
        for j, split in enumerate(splits):
            t = xs.float() @ a[s, j * rank : (j + 1) * rank].float().T
            delta = t @ b[s, off : off + split].float().T
            y[sel, off : off + split] += delta.to(y.dtype)
            off += split


def shrink(x: Tensor, a: Tensor, rows: Tensor) -> Tensor:
    """Per row, ``a[rows[i]] @ x[i]`` in float32 (``[n, a.shape[1]]``; zero for rows -1): the first
    half of `lora_add`, for layers that exchange it between tensor-parallel ranks."""
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
