"""The paged-attention kernels (decode with split KV, prefill / chunked prefill) against the torch
reference under the interpreter: grouped-query heads, sequences of different lengths, block tables
of scattered blocks, contexts split over several partitions, cached prefixes, sliding windows and
float8 caches (against attention over the dequantized cache). Outputs start as NaN, so a row the
kernel forgets fails; cache slots outside every context are NaN too, so reading one fails."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from sonar.kernels import reference
from sonar.kernels.attention import AttentionMetadata
from sonar.kernels.triton import (
    paged_attention,
    paged_decode_attention,
    paged_prefill_attention,
    write_kv_cache,
)
from tests.kernels.blocks import scattered_block_tables

BLOCK_SIZE, NUM_BLOCKS = 4, 48
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@dataclass
class Batch:
    query: torch.Tensor
    cache: torch.Tensor
    meta: AttentionMetadata
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype | None = None,
    per_head_scale: bool = False,
    seed: int = 0,
) -> Batch:
    """A paged cache holding every sequence's context in randomly scattered blocks (all other
    slots NaN), written by the reference, and the step's queries."""
    gen = torch.Generator().manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    tables = scattered_block_tables(seq_lens, BLOCK_SIZE, NUM_BLOCKS, gen)
    full = AttentionMetadata.build(seq_lens, seq_lens, tables, BLOCK_SIZE)  # every context slot
    total = sum(seq_lens)
    key = (torch.randn(total, num_kv_heads, head_dim, generator=gen) * 2).to(dtype)
    value = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)
    cache = torch.full((2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim), float("nan")).to(kv_dtype)
    k_scale = v_scale = None
    if kv_dtype == torch.float8_e4m3fn:
        k_scale, v_scale = reference.kv_scales(key, value, per_head=per_head_scale)
    reference.write_kv_cache(key, value, cache, full.slot_mapping, k_scale, v_scale)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    return Batch(query, cache, meta, k_scale, v_scale)


def expected(batch: Batch, window: int | None = None) -> torch.Tensor:
    scale = batch.query.shape[-1] ** -0.5
    return reference.paged_attention(batch.query, batch.cache, batch.meta, scale, window, batch.k_scale, batch.v_scale)


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert not torch.isnan(got).any(), f"{int(torch.isnan(got).sum())} output elements unwritten or NaN"
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


def decode(batch: Batch, window: int | None = None, num_splits: int = 1) -> torch.Tensor:
    m = batch.meta
    return paged_decode_attention(
        batch.query,
        batch.cache,
        m.block_tables,
        m.seq_lens,
        batch.query.shape[-1] ** -0.5,
        m.max_seq_len,
        window,
        batch.k_scale,
        batch.v_scale,
        num_splits=num_splits,
        out=poisoned_like(batch.query),
    )


def prefill(batch: Batch, window: int | None = None) -> torch.Tensor:
    m = batch.meta
    return paged_prefill_attention(
        batch.query,
        batch.cache,
        m.query_start_loc,
        m.seq_lens,
        m.block_tables,
        batch.query.shape[-1] ** -0.5,
        m.max_query_len,
        window,
        batch.k_scale,
        batch.v_scale,
        out=poisoned_like(batch.query),
    )


# --- decode ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_gqa_scattered_blocks(dtype: torch.dtype, num_splits: int) -> None:
    """Six query heads on two KV heads (a group of 3, padded to 16 rows), head_dim 24 (padded to
    32), four sequences of lengths 1 to 45; with 3 splits the short ones leave splits empty."""
    batch = make_batch([1, 1, 1, 1], [1, 45, 17, 4], num_heads=6, num_kv_heads=2, head_dim=24, dtype=dtype)
    assert_close(decode(batch, num_splits=num_splits), expected(batch), dtype)


def test_decode_many_partitions_of_a_long_context() -> None:
    """A context of 150 tokens in 8 partitions (of 32 tokens, two 16-token tiles each; the last
    one empty), one query head group of 8 sharing a single KV head."""
    batch = make_batch([1, 1], [150, 33], num_heads=8, num_kv_heads=1, head_dim=16, dtype=torch.float32, seed=1)
    assert_close(decode(batch, num_splits=8), expected(batch), torch.float32)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_sliding_window(num_splits: int) -> None:
    batch = make_batch([1, 1, 1], [40, 9, 23], num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, seed=2)
    assert_close(decode(batch, window=13, num_splits=num_splits), expected(batch, window=13), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_head", [False, True])
def test_decode_fp8_cache(dtype: torch.dtype, per_head: bool) -> None:
    batch = make_batch(
        [1, 1, 1],
        [30, 7, 52],
        num_heads=6,
        num_kv_heads=2,
        head_dim=16,
        dtype=dtype,
        kv_dtype=torch.float8_e4m3fn,
        per_head_scale=per_head,
        seed=3,
    )
    assert_close(decode(batch, num_splits=2), expected(batch), dtype)


# --- prefill and chunked prefill --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_prefill_mixed_batch(dtype: torch.dtype) -> None:
    """One batch: a whole prompt, a chunk over a 23-token cached prefix, a decode, and a chunk of
    one block's worth over a prefix that ends mid-block."""
    batch = make_batch([19, 6, 1, 4], [19, 29, 12, 10], num_heads=6, num_kv_heads=2, head_dim=24, dtype=dtype, seed=4)
    assert_close(prefill(batch), expected(batch), dtype)


def test_prefill_wide_group_and_long_chunk() -> None:
    """A group of 8 query heads per KV head (two tokens a 16-row tile) and a 27-token chunk."""
    batch = make_batch([27, 3], [40, 3], num_heads=8, num_kv_heads=1, head_dim=16, dtype=torch.float32, seed=5)
    assert_close(prefill(batch), expected(batch), torch.float32)


def test_prefill_sliding_window() -> None:
    batch = make_batch([21, 5, 1], [21, 30, 18], num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, seed=6)
    assert_close(prefill(batch, window=6), expected(batch, window=6), torch.float32)


@pytest.mark.parametrize("per_head", [False, True])
def test_prefill_fp8_cache(per_head: bool) -> None:
    batch = make_batch(
        [9, 4, 1],
        [9, 20, 33],
        num_heads=6,
        num_kv_heads=2,
        head_dim=16,
        dtype=torch.bfloat16,
        kv_dtype=torch.float8_e4m3fn,
        per_head_scale=per_head,
        seed=7,
    )
    assert_close(prefill(batch), expected(batch), torch.bfloat16)


# --- the two together, as a layer uses them ----------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_steps_through_the_kernels_match_the_reference(kv_dtype: torch.dtype) -> None:
    """Two sequences fed chunk by chunk: each step writes the new K/V with the write kernel and
    attends with ``paged_attention`` (prefill kernel for chunks, decode kernel for the all-decode
    step), against the same steps through the references on a second cache."""
    gen = torch.Generator().manual_seed(8)
    num_heads, num_kv_heads, head_dim, dtype = 4, 2, 16, torch.bfloat16
    steps = [[7, 5], [6, 1], [1, 1]]
    seq_lens = [sum(s[i] for s in steps) for i in range(2)]
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables = [perm[:4], perm[4:8]]
    got_cache = torch.full((2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim), float("nan")).to(kv_dtype)
    want_cache = got_cache.clone()
    k_scale = v_scale = None
    if kv_dtype == torch.float8_e4m3fn:
        k_scale, v_scale = torch.tensor([0.02]), torch.tensor([0.01])
    done = [0, 0]
    for step in steps:
        lens = [done[i] + step[i] for i in range(2)]
        meta = AttentionMetadata.build(step, lens, tables, BLOCK_SIZE)
        n = sum(step)
        q = torch.randn(n, num_heads, head_dim, generator=gen).to(dtype)
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        write_kv_cache(k, v, got_cache, meta.slot_mapping, k_scale, v_scale)
        reference.write_kv_cache(k, v, want_cache, meta.slot_mapping, k_scale, v_scale)
        got = paged_attention(q, got_cache, meta, head_dim**-0.5, None, k_scale, v_scale, out=poisoned_like(q))
        want = reference.paged_attention(q, want_cache, meta, head_dim**-0.5, None, k_scale, v_scale)
        assert_close(got, want, dtype)
        done = lens
    assert done == seq_lens
    assert torch.equal(got_cache.view(torch.uint8), want_cache.view(torch.uint8))


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_padding_sequence_of_length_zero_gives_zeros(num_splits: int) -> None:
    """A batch padded for a CUDA graph carries sequences of length 0: their rows come out 0, and
    the real rows are unaffected."""
    batch = make_batch([1, 1, 1], [21, 1, 9], num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, seed=9)
    want = expected(batch)
    batch.meta.seq_lens[1] = 0
    got = decode(batch, num_splits=num_splits)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    keep = [0, 2]
    assert_close(got[keep], want[keep], torch.float32)
