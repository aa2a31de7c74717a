"""Block tables for the attention tests: each sequence's blocks drawn at random from the cache."""

from __future__ import annotations

import torch


def scattered_block_tables(
    seq_lens: list[int], block_size: int, num_blocks: int, gen: torch.Generator
) -> list[list[int]]:
    """Enough distinct blocks for each sequence's length, in a random order over the whole cache."""
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for length in seq_lens:
        count = -(-length // block_size)
        tables.append(order[used : used + count])
        used += count
    assert used <= num_blocks
    return tables
