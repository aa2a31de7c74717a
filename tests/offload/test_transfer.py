"""gather_chunks / scatter_chunks against direct indexing of real per-layer KV caches."""

import pytest
import torch

from sonar.kernels.attention import allocate_kv_caches
from sonar.offload.layout import KVLayout
from sonar.offload.transfer import gather_chunks, scatter_chunks

LAYERS, BLOCKS, BS, HEADS, DIM = 3, 12, 4, 2, 8


def caches(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    kv = allocate_kv_caches(LAYERS, BLOCKS, BS, HEADS, DIM, dtype)
    for c in kv:
        c.copy_(torch.randn_like(c, dtype=torch.float32).to(dtype))
    return kv


@pytest.mark.parametrize("bpc", [1, 2, 4])
def test_gather_matches_direct_indexing(bpc):
    kv = caches()
    ids = [7, 2, 9, 0, 11, 3, 5, 1][: 2 * bpc]
    out = gather_chunks(kv, ids, bpc)
    assert out.shape == (len(ids) // bpc, LAYERS, 2, bpc, BS, HEADS, DIM)
    for c in range(len(ids) // bpc):
        assert out[c].is_contiguous()
        for layer in range(LAYERS):
            for kvi in range(2):
                for j in range(bpc):
                    assert torch.equal(out[c, layer, kvi, j], kv[layer][kvi, ids[c * bpc + j]])
    kv[0][0, ids[0]].fill_(123.0)  # the result does not alias the cache
    assert not torch.equal(out[0, 0, 0, 0], kv[0][0, ids[0]])


def test_chunk_shape_is_the_layouts():
    kv = caches()
    lay = KVLayout.for_caches(kv, model="m", blocks_per_chunk=2)
    assert gather_chunks(kv, [1, 2], 2)[0].shape == lay.chunk_shape
    assert lay.chunk_bytes == gather_chunks(kv, [1, 2], 2)[0].numel() * 4


@pytest.mark.parametrize("bpc", [1, 2, 4])
def test_scatter_round_trip_into_other_blocks(bpc):
    src = caches(seed=1)
    chunks = gather_chunks(src, [3, 4, 5, 6, 7, 8, 9, 10][: 2 * bpc], bpc)
    dst = caches(seed=2)
    before = [c.clone() for c in dst]
    targets = [0, 11, 1, 10, 2, 9, 8, 6][: 2 * bpc]
    scatter_chunks(dst, chunks, targets)
    for layer in range(LAYERS):
        for i, (s, t) in enumerate(zip([3, 4, 5, 6, 7, 8, 9, 10][: 2 * bpc], targets)):
            assert torch.equal(dst[layer][:, t], src[layer][:, s])
        untouched = [b for b in range(BLOCKS) if b not in targets]
        assert torch.equal(dst[layer][:, untouched], before[layer][:, untouched])


def test_scatter_skips_leading_blocks_and_trims_the_tail():
    src = caches(seed=3)
    chunks = gather_chunks(src, [0, 1, 2, 3, 4, 5, 6, 7], 4)  # two chunks of four blocks
    dst = caches(seed=4)
    before = [c.clone() for c in dst]
    # blocks 0 and 1 of the sequence are already in the primary cache; load blocks 2..6 only
    scatter_chunks(dst, list(chunks), [11, 10, 9, 8, 7], skip_blocks=2)
    for layer in range(LAYERS):
        for s, t in zip([2, 3, 4, 5, 6], [11, 10, 9, 8, 7]):
            assert torch.equal(dst[layer][:, t], src[layer][:, s])
        assert torch.equal(dst[layer][:, :7], before[layer][:, :7])


def test_bfloat16_round_trip():
    src = caches(seed=5, dtype=torch.bfloat16)
    dst = caches(seed=6, dtype=torch.bfloat16)
    scatter_chunks(dst, gather_chunks(src, [1, 2], 1), [5, 6])
    assert torch.equal(dst[2][:, 5], src[2][:, 1]) and torch.equal(dst[2][:, 6], src[2][:, 2])


def test_bad_arguments():
    kv = caches()
    with pytest.raises(ValueError, match="whole chunks"):
        gather_chunks(kv, [1, 2, 3], 2)
    chunks = gather_chunks(kv, [1, 2], 2)
    with pytest.raises(ValueError, match="cannot fill"):
        scatter_chunks(kv, chunks, [1, 2, 3])
    with pytest.raises(ValueError, match="dtype"):
        scatter_chunks(kv, chunks.to(torch.float16), [1, 2])
