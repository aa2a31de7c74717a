"""The split form of the batched LoRA delta that the fully sharded layers exchange between ranks
(`sonar.kernels.lora.shrink` and `expand`), against the per-row formula."""

from __future__ import annotations

import torch

from sonar.kernels.lora import expand, shrink


def test_shrink_then_expand_is_each_rows_delta() -> None:
    g = torch.Generator().manual_seed(0)
    slots, rank, fan_in, splits = 3, 4, 24, (8, 5, 5)
    a = torch.randn(slots, len(splits) * rank, fan_in, generator=g)
    b = torch.randn(slots, sum(splits), rank, generator=g)
    x = torch.randn(6, fan_in, generator=g)
    rows = torch.tensor([2, -1, 0, 2, 1, -1])
    base = torch.randn(6, sum(splits), generator=g)
    y = base.clone()
    t = shrink(x, a, rows)
    expand(y, t, b, rows, splits)
    for i, slot in enumerate(rows.tolist()):
        expected = base[i].clone()
        if slot >= 0:
            offset = 0
            for j, split in enumerate(splits):
                down = a[slot, j * rank : (j + 1) * rank]
                expected[offset : offset + split] += b[slot, offset : offset + split] @ (down @ x[i])
                offset += split
        else:
            assert not t[i].any()
        torch.testing.assert_close(y[i], expected, rtol=1e-5, atol=1e-5)


def test_expand_writes_through_a_column_view() -> None:
    """A row-parallel rank adds its slice of the output columns into the base layer's output."""
    a = torch.ones(1, 2, 3)
    b = torch.ones(1, 4, 2)
    x = torch.ones(2, 3)
    rows = torch.tensor([0, -1])
    y = torch.zeros(2, 8)
    expand(y.narrow(1, 4, 4), shrink(x, a, rows), b, rows, (4,))
    assert y[0].tolist() == [0, 0, 0, 0, 6, 6, 6, 6] and not y[1].any()
