"""The packed token bitmask: one int32 row per constrained request, bit ``t % 32`` of word
``t // 32`` set when token ``t`` may come next (xgrammar's and llguidance's layout).

The scheduler fills rows (`GrammarMatcher.fill_bitmask`) into a preallocated CPU tensor; the
worker applies them to its logits before sampling: on CUDA with xgrammar's kernel, elsewhere by
unpacking the rows with one shift and mask (no loop over tokens) and filling -inf.
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
    vocabulary it was made for) are forbidden."""
    if not len(rows):
        return
    vocab = logits.shape[1]
    if logits.is_cuda and logits.is_contiguous() and bitmask_words(vocab) == bitmask.shape[1]:
        import xgrammar

        # the kernel reads bitmask row r for logits row r
        full = torch.empty((logits.shape[0], bitmask.shape[1]), dtype=torch.int32)
        full[list(rows)] = bitmask
        mask = full.to(logits.device, non_blocking=True)
        xgrammar.apply_token_bitmask_inplace(logits, mask, vocab_size=vocab, indices=list(rows))
        return
    bitmask = bitmask.to(logits.device)
    allowed = unpack_allowed(bitmask, min(vocab, bitmask.shape[1] * 32))
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    if list(rows) == list(range(logits.shape[0])):
        logits.masked_fill_(~allowed, float("-inf"))
        return
    index = torch.tensor(list(rows), device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
