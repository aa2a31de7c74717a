"""PLACEHOLDER reference until the kernels land."""

from __future__ import annotations

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
