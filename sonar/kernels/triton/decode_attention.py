"""Paged attention for decode: one query token per sequence, split over the KV length.

Reference: :func:`sonar.kernels.reference.paged_attention` (a batch of decodes: ``query_len`` 1).
Layout and conventions are :mod:`sonar.kernels.attention`'s: cache ``[2, num_blocks, block_size,
num_kv_heads, head_dim]``, ``block_tables`` int32 ``[num_seqs, max_blocks]``, ``seq_lens`` int32
(context length including the new token, already written to the cache).

Grid ``(num_seqs, num_kv_heads, num_splits)``. A program takes one sequence, one KV head and the
whole group of query heads that read it (grouped-query attention: the group is padded to at least
16 rows so the scores are one ``tl.dot``), and one contiguous share of the context, which it walks
in tiles of ``TILE_N`` tokens, gathering each token's row through the block table, with an online
softmax in base 2. With one split the program writes the output; with several, each writes its
partial output and log-sum-exp and a second kernel (:func:`_decode_reduce_kernel`) combines them,
so long contexts and small batches still fill the GPU. A float8 cache is read with its scales: the
key scale folds into the softmax scale and the value scale into the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sonar.kernels.triton._common import (
    check_fp8_supported,
    check_last_dim_contiguous,
    device_of,
    dot_in_fp32,
    interpreting,
    next_power_of_2,
    softcap_scores,
)

LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    k_scale_ptr,
    v_scale_ptr,
    sinks_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    qk_scale,
    q_stride_t,
    q_stride_h,
    o_stride_t,
    o_stride_h,
    bt_stride,
    c_stride_kv,
    c_stride_block,
    c_stride_tok,
    c_stride_head,
    head_dim,
    window,
    softcap,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr,
    SCALE_PER_HEAD: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_SINKS: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(seq_len - window, 0)
    per_split = tl.cdiv(tl.cdiv(seq_len - kv_lo, NUM_SPLITS), TILE_N) * TILE_N
    start = kv_lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, BLOCK_D)
    row_mask = rows < GROUP
    dim_mask = dims < head_dim
    heads = kv_head * GROUP + rows
    q = tl.load(
        q_ptr + seq.to(tl.int64) * q_stride_t + heads[:, None] * q_stride_h + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)

    scale = qk_scale
    v_scale = 1.0
    if KV_FP8:
        if SCALE_PER_HEAD:
            scale = scale * tl.load(k_scale_ptr + kv_head)
            v_scale = tl.load(v_scale_ptr + kv_head)
        else:
            scale = scale * tl.load(k_scale_ptr)
            v_scale = tl.load(v_scale_ptr)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    if USE_SINKS:
        # a sink is a logit with no value (base-2 units, scaled on the host): the first split
        # starts its softmax as if it had seen it, and the reduction carries it to the others
        sinks_here = row_mask & (split == 0)
        m_i = tl.where(sinks_here, tl.load(sinks_ptr + heads, mask=sinks_here, other=0.0), m_i)
        l_i = tl.where(sinks_here, 1.0, l_i)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * bt_stride
    head_base = cache_ptr + kv_head * c_stride_head
    for tile in range(start, end, TILE_N):
        toks = tile + tl.arange(0, TILE_N)
        tok_mask = toks < end
        blocks = tl.load(table + toks // BLOCK_SIZE, mask=tok_mask, other=0).to(tl.int64)
        rows_off = blocks * c_stride_block + (toks % BLOCK_SIZE) * c_stride_tok
        kv_mask = tok_mask[:, None] & dim_mask[None, :]
        k = tl.load(head_base + rows_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(head_base + c_stride_kv + rows_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        if USE_SOFTCAP:
            s = softcap_scores(s, softcap)
        s = tl.where(tok_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None] * v_scale
    out_mask = row_mask[:, None] & dim_mask[None, :]
    if NUM_SPLITS == 1:
        dst = out_ptr + seq.to(tl.int64) * o_stride_t + heads[:, None] * o_stride_h + dims[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # partials: out [num_seqs, num_heads, NUM_SPLITS, head_dim], lse [num_seqs, num_heads, NUM_SPLITS]
        part = (seq.to(tl.int64) * NUM_HEADS + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + part[:, None] * head_dim + dims[None, :], out, mask=out_mask)
        lse = tl.where(has_keys, m_i + tl.math.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_mask)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    o_stride_t,
    o_stride_h,
    head_dim,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, BLOCK_D)
    split_mask = splits < NUM_SPLITS
    part = (seq.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS + splits
    lse = tl.load(part_lse_ptr + part, mask=split_mask, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # no keys at all (a padding sequence): output 0
    weights = tl.math.exp2(lse - top)
    parts = tl.load(
        part_out_ptr + part[:, None] * head_dim + dims[None, :],
        mask=split_mask[:, None] & (dims < head_dim)[None, :],
        other=0.0,
    )
    total = tl.sum(weights, 0)
    out = tl.sum(parts * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
    dst = out_ptr + seq.to(tl.int64) * o_stride_t + head * o_stride_h + dims
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=dims < head_dim)


def default_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Enough splits to give the GPU about four programs per multiprocessor, never splitting a
    context into shares of fewer than 256 tokens; a power of two, at most 64."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    splits = 1
    while num_seqs * num_kv_heads * splits < 4 * sms and max_seq_len >= 2 * 256 * splits and splits < 64:
        splits *= 2
    return splits


def paged_decode_attention(
    query: Tensor,
    kv_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    max_seq_len: int,
    sliding_window: int | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    num_splits: int | None = None,
    out: Tensor | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    tile_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> Tensor:
    """Attention of one query token per sequence (``query`` ``[num_seqs, num_heads, head_dim]``)
    over its cached context; returns ``[num_seqs, num_heads, head_dim]`` in ``query.dtype``.

    ``max_seq_len`` (host int) only sizes the default split count; ``num_splits`` fixes it (a
    CUDA graph needs the same value at capture and replay). A sequence of length 0 gets zeros.
    ``softcap`` caps each scaled score ``s`` to ``softcap * tanh(s / softcap)`` before the softmax;
    ``sinks`` ``[num_heads]`` (None: off) join each head's softmax denominator with no value.
    ``tile_n`` (tokens per loop step, a power of two >= 16), ``num_warps`` and ``num_stages`` are
    tuning knobs (the benchmark sweeps them).
    """
    num_seqs, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, cache_dim = kv_cache.shape
    if cache_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"query {tuple(query.shape)} does not fit cache {tuple(kv_cache.shape)}")
    check_last_dim_contiguous(query, kv_cache)
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    if fp8 and (k_scale is None or v_scale is None):
        raise ValueError("an fp8 KV cache needs k_scale and v_scale")
    if fp8:
        check_fp8_supported(kv_cache)
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, num_kv_heads, max_seq_len, query.device)
    group = num_heads // num_kv_heads
    block_d = max(next_power_of_2(head_dim), 16)
    if tile_n is None:
        tile_n = 16 if interpreting() else 64  # small tiles keep the interpreter tests fast
    if tile_n < 16 or tile_n & (tile_n - 1):
        raise ValueError(f"tile_n must be a power of two >= 16, got {tile_n}")
    if num_splits > 1:
        part_out = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device)
        part_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out  # unused
    dummy = seq_lens
    with device_of(query):
        _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
            query,
            kv_cache,
            block_tables,
            seq_lens,
            k_scale if fp8 else dummy,
            v_scale if fp8 else dummy,
            dummy if sinks is None else (sinks.float() * LOG2E).contiguous(),
            out,
            part_out,
            part_lse,
            scale * LOG2E,
            query.stride(0),
            query.stride(1),
            out.stride(0),
            out.stride(1),
            block_tables.stride(0),
            kv_cache.stride(0),
            kv_cache.stride(1),
            kv_cache.stride(2),
            kv_cache.stride(3),
            head_dim,
            sliding_window or 0,
            (softcap or 0.0) * LOG2E,
            NUM_HEADS=num_heads,
            NUM_SPLITS=num_splits,
            GROUP=group,
            GROUP_PAD=max(next_power_of_2(group), 16),
            BLOCK_SIZE=block_size,
            TILE_N=tile_n,
            BLOCK_D=block_d,
            KV_FP8=fp8,
            SCALE_PER_HEAD=fp8 and k_scale.numel() > 1,
            USE_WINDOW=sliding_window is not None,
            USE_SOFTCAP=softcap is not None,
            USE_SINKS=sinks is not None,
            DOT_F32=dot_in_fp32(query.dtype),
            num_warps=num_warps,
            num_stages=num_stages,
        )
        if num_splits > 1:
            _decode_reduce_kernel[(num_seqs, num_heads)](
                part_out,
                part_lse,
                out,
                out.stride(0),
                out.stride(1),
                head_dim,
                NUM_HEADS=num_heads,
                NUM_SPLITS=num_splits,
                SPLITS_PAD=next_power_of_2(num_splits),
                BLOCK_D=block_d,
                num_warps=4,
            )
    return out


def bytes_moved(
    num_seqs: int, context: int, num_heads: int, num_kv_heads: int, head_dim: int, kv_bytes: int, q_bytes: int
) -> int:
    """Bytes a decode step must move at least: every context token's K and V once, plus the
    query and output rows (for the achieved-bandwidth figure of the benchmarks)."""
    return num_seqs * (2 * context * num_kv_heads * head_dim * kv_bytes + 2 * num_heads * head_dim * q_bytes)


__all__ = ["paged_decode_attention", "default_num_splits", "bytes_moved"]
