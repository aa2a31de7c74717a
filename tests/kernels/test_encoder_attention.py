"""encoder_attention: each sequence of a flat batch attends bidirectionally to its own rows only."""

from __future__ import annotations

import pytest
import torch

from sonar.kernels.attention import AttentionMetadata
from sonar.kernels.encoder_attention import encoder_attention, sequence_starts


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], scale: float) -> torch.Tensor:
    """Per sequence, per head: softmax(q k^T * scale) v in float64."""
    out, start = [], 0
    for n in lens:
        rows = slice(start, start + n)
        qs, ks, vs = (x[rows].double().transpose(0, 1) for x in (q, k, v))
        out.append((torch.softmax(qs @ ks.transpose(1, 2) * scale, dim=-1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(out).to(q.dtype)


def metadata(lens: list[int]) -> AttentionMetadata:
    return AttentionMetadata.build(lens, lens, [[0] * -(-n // 16) for n in lens], 16)


@pytest.mark.parametrize("lens", [[5], [7, 1, 12, 3], [4, 4, 4]])
def test_matches_per_sequence_softmax(lens: list[int]) -> None:
    torch.manual_seed(0)
    n = sum(lens)
    q, k, v = (torch.randn(n, 4, 8) for _ in range(3))
    starts = sequence_starts(metadata(lens))
    assert starts == [0, *torch.tensor(lens).cumsum(0).tolist()]
    out = encoder_attention(q, k, v, starts, 8**-0.5)
    assert out.shape == q.shape
    torch.testing.assert_close(out, reference(q, k, v, lens, 8**-0.5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lens", [[6, 3, 5], [4, 4, 4]], ids=["mixed", "equal"])
def test_sequences_do_not_see_each_other(lens: list[int]) -> None:
    torch.manual_seed(1)
    q, k, v = (torch.randn(sum(lens), 2, 8) for _ in range(3))
    starts = sequence_starts(metadata(lens))
    before = encoder_attention(q, k, v, starts, 0.3)
    middle = slice(starts[1], starts[2])  # only the middle sequence's keys and values change
    k2, v2 = k.clone(), v.clone()
    k2[middle], v2[middle] = torch.randn(lens[1], 2, 8), torch.randn(lens[1], 2, 8)
    after = encoder_attention(q, k2, v2, starts, 0.3)
    torch.testing.assert_close(after[: starts[1]], before[: starts[1]])
    torch.testing.assert_close(after[starts[2] :], before[starts[2] :])
    assert not torch.allclose(after[middle], before[middle])


def test_bfloat16() -> None:
    torch.manual_seed(2)
    lens = [9, 2]
    q, k, v = (torch.randn(11, 4, 16, dtype=torch.bfloat16) for _ in range(3))
    out = encoder_attention(q, k, v, sequence_starts(metadata(lens)), 0.25)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(
        out.float(), reference(q.float(), k.float(), v.float(), lens, 0.25), atol=2e-2, rtol=2e-2
    )
