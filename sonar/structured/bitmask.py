"""The packed token bitmask: one int32 row per constrained request, bit ``t % 32`` of word
``t // 32`` set when token ``t`` may come next (xgrammar's and llguidance's layout).

The scheduler fills rows (`GrammarMatcher.fill_bitmask`) into a preallocated CPU tensor; the
worker applies them to its logits before sampling with xgrammar's kernel (`apply_token_bitmask`).
`pack_allowed` and `unpack_allowed` convert between the bitmask and a bool tensor, for tests and
diagnostics that read what a grammar allows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_BITS = torch.arange(32, dtype=torch.int32)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An int32 ``[rows, words]`` CPU bitmask, every token allowed."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def pack_allowed(allowed: torch.Tensor) -> torch.Tensor:
    """The bitmask of a bool ``[rows, vocab]`` tensor (True: allowed)."""
    rows, vocab = allowed.shape
    words = bitmask_words(vocab)
    padded = torch.zeros(rows, words * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.to(torch.int64)
    packed = (padded.view(rows, words, 32) << _BITS.to(torch.int64)).sum(dim=-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The bool ``[rows, vocab_size]`` tensor of a bitmask (True: allowed)."""
    bits = _BITS.to(bitmask.device)
    return ((bitmask.unsqueeze(-1) >> bits) & 1).view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set to -inf, in place, the logits of the tokens `bitmask` forbids: bitmask row ``i`` masks
    logits row ``rows[i]``. Tokens past the bitmask's words (a logits row wider than the
    vocabulary it was made for) are forbidden.

    xgrammar's kernel does the work on every device (CUDA, and vectorized C++ on the CPU: for 16
    rows of a 49k vocabulary it takes ~0.1 ms where unpacking the bits with torch ops took ~15 ms).
    """
    if not len(rows):
        return
    import xgrammar

    rows = list(rows)
    vocab = logits.shape[1]
    covered = min(vocab, bitmask.shape[1] * 32)
    # the kernel reads bitmask row r for logits row r
    if rows == list(range(logits.shape[0])):
        full = bitmask
    else:
        full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
        full[rows] = bitmask
    target = logits if logits.is_contiguous() else logits.contiguous()
    xgrammar.apply_token_bitmask_inplace(
        target, full.to(logits.device, non_blocking=True), vocab_size=covered, indices=rows
    )
    if covered < vocab:
        target[rows, covered:] = float("-inf")
    if target is not logits:
        logits.copy_(target)
