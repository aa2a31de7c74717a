"""Bidirectional (non-causal) attention over a flat batch, for encoder models.

An encoder step holds whole sequences back to back (``query_start_loc`` of `AttentionMetadata`
gives each one's rows); every token attends to every token of its own sequence and to nothing
else. Nothing is cached: keys and values are this step's.

Each sequence is one SDPA call over its own rows. Measured on 2 CPU cores against one padded
SDPA call with a key-padding mask (32 sequences, 12 heads of 64): equal lengths of 256 the same
(62-74 ms either way), lengths 64-256 per sequence 1.3-2.6x faster (32 vs 83 ms float32, 36 vs
48 ms bfloat16): unmasked calls take SDPA's flash kernel, and no padded rows are computed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn.functional as F
from torch import Tensor

from sonar.kernels.attention import AttentionMetadata


def sequence_starts(meta: AttentionMetadata) -> list[int]:
    """``query_start_loc`` as a host list, read once per step rather than once per layer."""
    return [int(s) for s in meta.query_start_loc.tolist()]


def encoder_attention(q: Tensor, k: Tensor, v: Tensor, starts: Sequence[int], scale: float) -> Tensor:
    """``q``/``k``/``v`` ``[num_tokens, num_heads, head_dim]`` to the output, shaped as ``q``:
    sequence ``i`` (rows ``starts[i]:starts[i + 1]``) attending over its own rows only."""
    out = q.new_empty(q.shape)
    for begin, end in zip(starts[:-1], starts[1:]):
        rows = slice(begin, end)
        o = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1), k[rows].transpose(0, 1), v[rows].transpose(0, 1), scale=scale
        )
        out[rows] = o.transpose(0, 1)
    return out
