"""The paged-attention reference against dense causal attention computed from whole sequences."""

from __future__ import annotations

import math

import pytest
import torch

from sonar.kernels.attention import (
    AttentionMetadata,
    allocate_kv_caches,
    paged_attention,
    seq_of_tokens,
    write_kv_cache,
)
from tests.kernels.blocks import scattered_block_tables

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 16, 4, 96


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
    """Plain softmax attention of a whole sequence's queries ``[L, H, D]`` over its K/V ``[L, Hkv, D]``,
    returned for every position; float64 so it is the exact side of the comparison."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).double()
    v = v.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(q.shape[-1])
    pos = torch.arange(q.shape[0])
    allowed = pos[None, :] <= pos[:, None]
    if window is not None:
        allowed &= pos[None, :] > pos[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_steps(
    seq_lens: list[int],
    steps: list[list[int]],
    dtype: torch.dtype,
    window: int | None = None,
    seed: int = 0,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Feed each sequence's tokens through the paged cache in the given chunks (``steps[s][i]``
    new tokens of sequence ``i`` in step ``s``; 0 skips it) and return, per sequence, the paged
    outputs of all its positions next to the dense reference."""
    gen = torch.Generator().manual_seed(seed)
    qs = [torch.randn(n, NUM_HEADS, HEAD_DIM, generator=gen) for n in seq_lens]
    ks = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen) for n in seq_lens]
    vs = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen) for n in seq_lens]
    (cache,) = allocate_kv_caches(1, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype)
    cache.fill_(float("nan"))
    tables = scattered_block_tables(seq_lens, BLOCK_SIZE, NUM_BLOCKS, gen)
    outs: list[list[torch.Tensor]] = [[] for _ in seq_lens]
    done = [0] * len(seq_lens)
    for step in steps:
        active = [i for i, n in enumerate(step) if n]
        q_lens = [step[i] for i in active]
        s_lens = [done[i] + step[i] for i in active]
        meta = AttentionMetadata.build(q_lens, s_lens, [tables[i] for i in active], BLOCK_SIZE)
        rows = [(i, done[i], done[i] + step[i]) for i in active]
        q = torch.cat([qs[i][a:b] for i, a, b in rows]).to(dtype)
        k = torch.cat([ks[i][a:b] for i, a, b in rows]).to(dtype)
        v = torch.cat([vs[i][a:b] for i, a, b in rows]).to(dtype)
        write_kv_cache(k, v, cache, meta.slot_mapping)
        out = paged_attention(q, cache, meta, scale=HEAD_DIM**-0.5, sliding_window=window)
        assert out.shape == q.shape and out.dtype == dtype
        for (i, a, b), part in zip(rows, out.split(q_lens)):
            outs[i].append(part.float())
            done[i] = b
    assert done == seq_lens
    got = [torch.cat(o) for o in outs]
    want = [dense_attention(qs[i], ks[i], vs[i], window).float() for i in range(len(seq_lens))]
    return got, want


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("window", [None, 5])
def test_mixed_prefill_chunked_prefill_and_decode(dtype: torch.dtype, tol: float, window: int | None) -> None:
    seq_lens = [13, 7, 22, 1, 9]
    steps = [
        [5, 7, 8, 1, 0],  # two prefill chunks, a whole prefill, a one-token prompt, one waiting
        [1, 0, 10, 0, 9],  # a decode next to a chunk over a cached prefix and a new prefill
        [4, 0, 1, 0, 0],  # a chunk after a decode; a decode after chunks
        [1, 0, 1, 0, 0],  # decode-only step (the batched path)
        [1, 0, 1, 0, 0],
        [1, 0, 1, 0, 0],
    ]
    got, want = run_steps(seq_lens, steps, dtype, window)
    for g, w in zip(got, want):
        assert not g.isnan().any()
        torch.testing.assert_close(g, w, atol=tol, rtol=tol)


def test_decode_batch_with_uneven_lengths_crossing_block_edges() -> None:
    seq_lens = [BLOCK_SIZE * 3 + 2, 1 + 4, BLOCK_SIZE, 2 * BLOCK_SIZE + 1]
    prompts = [n - 4 for n in seq_lens]
    steps = [prompts] + [[1] * len(seq_lens)] * 4
    got, want = run_steps(seq_lens, steps, torch.float32, seed=3)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_token_by_token_equals_one_prefill() -> None:
    got, want = run_steps([11], [[1]] * 11, torch.float32, seed=5)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)


def test_metadata_build() -> None:
    meta = AttentionMetadata.build([3, 1], [5, 9], [[7, 2], [4, 0, 6]], block_size=4)
    assert meta.query_start_loc.tolist() == [0, 3, 4]
    assert meta.seq_lens.tolist() == [5, 9]
    assert meta.block_tables.tolist() == [[7, 2, 0], [4, 0, 6]]
    # seq 0 positions 2,3,4 -> block 7 offsets 2,3 then block 2 offset 0; seq 1 position 8 -> block 6
    assert meta.slot_mapping.tolist() == [30, 31, 8, 24]
    assert (meta.max_query_len, meta.max_seq_len, meta.num_seqs, meta.num_tokens) == (3, 9, 2, 4)
    with pytest.raises(ValueError, match="cannot hold"):
        AttentionMetadata.build([1], [9], [[1, 2]], block_size=4)


@pytest.mark.parametrize("q_lens", [[1] * 64, [1, 1, 5, 1, 128, 2], [2048], [3]])
def test_seq_of_tokens(q_lens: list[int]) -> None:
    lens = torch.tensor(q_lens)
    start = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
    torch.cumsum(lens, 0, out=start[1:])
    got = seq_of_tokens(start, sum(q_lens))
    assert got.tolist() == torch.repeat_interleave(torch.arange(len(q_lens)), lens).tolist()
