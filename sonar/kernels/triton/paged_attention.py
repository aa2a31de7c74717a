"""Paged attention over :class:`sonar.kernels.attention.AttentionMetadata`: the Triton twin of
:func:`sonar.kernels.attention.paged_attention` (same arguments, same result).

A batch of decodes only (every query length 1) runs the split-KV decode kernel; any batch with a
longer query runs the prefill kernel, which serves its decodes too.
"""

from __future__ import annotations

from torch import Tensor

from sonar.kernels.attention import AttentionMetadata
from sonar.kernels.triton.decode_attention import paged_decode_attention
from sonar.kernels.triton.prefill_attention import paged_prefill_attention


def paged_attention(
    query: Tensor,
    kv_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    num_splits: int | None = None,
    out: Tensor | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    if meta.max_query_len <= 1 and query.shape[0] == meta.num_seqs:
        return paged_decode_attention(
            query,
            kv_cache,
            meta.block_tables,
            meta.seq_lens,
            scale,
            meta.max_seq_len,
            sliding_window,
            k_scale,
            v_scale,
            num_splits=num_splits,
            out=out,
            softcap=softcap,
            sinks=sinks,
        )
    return paged_prefill_attention(
        query,
        kv_cache,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        scale,
        meta.max_query_len,
        sliding_window,
        k_scale,
        v_scale,
        out=out,
        softcap=softcap,
        sinks=sinks,
    )
