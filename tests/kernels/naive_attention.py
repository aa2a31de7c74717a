"""Paged attention the slowest, plainest way: the float64 reference the soft-cap and sink tests
check `sonar.kernels.reference` against."""

from __future__ import annotations

import torch

from tests.kernels.test_triton_attention import BLOCK_SIZE, Batch

MIXED = ([1, 7, 1, 12], [30, 7, 9, 20])  # decodes, a fresh prefill, a chunk over a cached prefix


def naive_attention(
    batch: Batch,
    scale: float,
    window: int | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention one query row and head at a time, reading each context position's key and value
    through the block table, in float64; a `softcap` caps the scaled scores (``c * tanh(s / c)``),
    `sinks` (one logit per head) join the softmax and are dropped after it."""
    query, cache, meta = batch.query, batch.cache, batch.meta
    num_heads, num_kv_heads = query.shape[1], cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.zeros(query.shape, dtype=torch.float64)
    starts = meta.query_start_loc.tolist()
    for i, seq_len in enumerate(meta.seq_lens.tolist()):
        table = meta.block_tables[i].tolist()
        q_len = starts[i + 1] - starts[i]
        for j in range(q_len):
            row, pos = starts[i] + j, seq_len - q_len + j
            first = 0 if window is None else max(0, pos - window + 1)
            slots = [(table[p // BLOCK_SIZE], p % BLOCK_SIZE) for p in range(first, pos + 1)]
            for h in range(num_heads):
                k = torch.stack([cache[0, b, o, h // group] for b, o in slots]).double()
                v = torch.stack([cache[1, b, o, h // group] for b, o in slots]).double()
                s = k @ query[row, h].double() * scale
                if softcap is not None:
                    s = softcap * torch.tanh(s / softcap)
                if sinks is not None:
                    s = torch.cat([s, sinks[h : h + 1].double()])
                out[row, h] = torch.softmax(s, dim=0)[: len(slots)] @ v
    return out
