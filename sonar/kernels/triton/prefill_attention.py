"""Paged attention for prefill and chunked prefill: variable-length queries, causal, over a paged
prefix plus themselves.

Reference: :func:`sonar.kernels.reference.paged_attention`. Conventions are
:mod:`sonar.kernels.attention`'s: a flat batch (sequence ``i`` owns query rows
``query_start_loc[i]:query_start_loc[i + 1]``, the last ``query_len`` positions of its
``seq_lens[i]`` tokens); every key and value, the new tokens' included, is read from the cache,
so ``write_kv_cache`` runs first. Any mix of prefills, chunks over a cached prefix and decodes
(query length 1) is served by this kernel.

Grid ``(cdiv(max_query_len, BLOCK_Q), num_seqs, num_kv_heads)``. A program takes ``BLOCK_Q`` query
tokens of one sequence and all ``GROUP`` query heads that share one KV head, packed into the
``BLOCK_M`` rows of one tile (row ``r`` is token ``r // GROUP``, head ``r % GROUP``), so each key
and value tile gathered through the block table serves the whole group. Keys run from the first
one any of its queries may see (0, or the sliding window's start) to its last query's position;
the causal (and window) mask is applied per row, with an online softmax in base 2.
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
def _prefill_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    query_start_ptr,
    seq_lens_ptr,
    k_scale_ptr,
    v_scale_ptr,
    sinks_ptr,
    out_ptr,
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
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
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
    q_block = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    q_idx = q_block * BLOCK_Q + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_mask = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    dim_mask = dims < head_dim
    q_rows = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * q_stride_t + heads[:, None] * q_stride_h + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)
    q_pos = prefix + q_idx

    scale = qk_scale
    v_scale = 1.0
    if KV_FP8:
        if SCALE_PER_HEAD:
            scale = scale * tl.load(k_scale_ptr + kv_head)
            v_scale = tl.load(v_scale_ptr + kv_head)
        else:
            scale = scale * tl.load(k_scale_ptr)
            v_scale = tl.load(v_scale_ptr)

    last = tl.minimum(prefix + (q_block + 1) * BLOCK_Q, seq_len)  # one past the last query's position
    first = 0
    if USE_WINDOW:
        first = tl.maximum(prefix + q_block * BLOCK_Q - window + 1, 0)
        first = (first // TILE_N) * TILE_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if USE_SINKS:
        # a sink is a logit with no value (base-2 units, scaled on the host): start each row's
        # softmax as if it had seen it
        m_i = tl.where(row_mask, tl.load(sinks_ptr + heads, mask=row_mask, other=0.0), m_i)
        l_i = tl.where(row_mask, 1.0, l_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * bt_stride
    head_base = cache_ptr + kv_head * c_stride_head
    for tile in range(first, last, TILE_N):
        toks = tile + tl.arange(0, TILE_N)
        tok_mask = toks < last
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
        allowed = tok_mask[None, :] & (toks[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            allowed = allowed & (toks[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing to see yet
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * v_scale
    dst = out_ptr + q_rows[:, None] * o_stride_t + heads[:, None] * o_stride_h + dims[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


def paged_prefill_attention(
    query: Tensor,
    kv_cache: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    block_tables: Tensor,
    scale: float,
    max_query_len: int,
    sliding_window: int | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    out: Tensor | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Causal attention of a flat batch ``query`` ``[num_tokens, num_heads, head_dim]`` over each
    sequence's cached context; returns the same shape in ``query.dtype``. ``max_query_len`` (a
    host int) sizes the grid. ``softcap`` caps each scaled score ``s`` to
    ``softcap * tanh(s / softcap)`` before the softmax; ``sinks`` ``[num_heads]`` (None: off) join
    each head's softmax denominator with no value."""
    num_tokens, num_heads, head_dim = query.shape
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
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    on_gpu = not interpreting()  # the interpreter: small tiles keep the tests fast
    block_m = max(64 if on_gpu else 16, next_power_of_2(group))
    block_q = block_m // group
    tile_n = (64 if block_size <= 64 else block_size) if on_gpu else 16
    block_d = max(next_power_of_2(head_dim), 16)
    dummy = seq_lens
    grid = (triton.cdiv(max_query_len, block_q), num_seqs, num_kv_heads)
    with device_of(query):
        _prefill_kernel[grid](
            query,
            kv_cache,
            block_tables,
            query_start_loc,
            seq_lens,
            k_scale if fp8 else dummy,
            v_scale if fp8 else dummy,
            dummy if sinks is None else (sinks.float() * LOG2E).contiguous(),
            out,
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
            GROUP=group,
            BLOCK_Q=block_q,
            BLOCK_M=block_m,
            BLOCK_SIZE=block_size,
            TILE_N=tile_n,
            BLOCK_D=block_d,
            KV_FP8=fp8,
            SCALE_PER_HEAD=fp8 and k_scale.numel() > 1,
            USE_WINDOW=sliding_window is not None,
            USE_SOFTCAP=softcap is not None,
            USE_SINKS=sinks is not None,
            DOT_F32=dot_in_fp32(query.dtype),
            num_warps=4,
            num_stages=2,
        )
    return out


def flops(query_lens: list[int], seq_lens: list[int], num_heads: int, head_dim: int) -> int:
    """Useful attention FLOPs of a batch (two matmuls, causal pairs only), for the benchmarks."""
    total = 0
    for q, s in zip(query_lens, seq_lens):
        prefix = s - q
        pairs = q * prefix + q * (q + 1) // 2
        total += 4 * pairs * num_heads * head_dim
    return total
