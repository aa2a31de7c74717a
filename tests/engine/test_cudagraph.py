"""CUDA graph sizes and the padded decode path they replay, run on the CPU without capture.

A padded decode batch must give the real rows the same tokens as the unpadded batch and must not
touch any KV block it does not own. Bit-exact logits are only expected for the same row count:
on some CPUs (the AMD EPYCs CI has run on) torch's GEMM picks its kernel by the number of rows,
so ``linear(x[:3])`` and ``linear(x[:4])[:3]`` differ in the last bits, while on others (an Intel
Xeon) they agree; padded rows change the row count, so across sizes the hidden states
are held to float32 rounding (~1e-6).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sonar.engine.config import EngineConfig
from sonar.engine.cudagraph import DecodeBuffers, padded_size
from sonar.engine.runner import ModelRunner
from sonar.engine.settings import capture_sizes, default_capture_sizes
from sonar.kernels.attention import AttentionMetadata

BLOCK = 16
NUM_BLOCKS = 64


def sizes(**args) -> list[int]:
    return capture_sizes(EngineConfig.from_args(**args))


def test_default_sizes_follow_the_documented_pattern() -> None:
    expected = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]
    assert sizes(max_num_batched_tokens=8192) == expected  # max_num_seqs 256: max = min(512, 512)
    assert sizes(max_num_seqs=8, max_num_batched_tokens=8192) == [1, 2, 4, 8, 16]  # max = 16
    assert sizes(max_num_seqs=100, max_num_batched_tokens=8192)[-1] == 200
    assert default_capture_sizes(300) == [1, 2, 4, *range(8, 256, 8), 256, 272, 288]


def test_sizes_above_the_token_budget_are_dropped() -> None:
    assert sizes()[-1] == 512  # the default budget is 512 tokens
    assert sizes(max_num_batched_tokens=64, max_num_seqs=32)[-1] == 64


def test_explicit_sizes_are_sorted_deduplicated_and_checked() -> None:
    assert sizes(cudagraph_capture_sizes=[8, 1, 4, 4]) == [1, 4, 8]
    assert sizes(cudagraph_capture_sizes=[8, 1], max_cudagraph_capture_size=8) == [1, 8]
    assert sizes(max_cudagraph_capture_size=20) == [1, 2, 4, 8, 16]
    with pytest.raises(ValueError, match="must be positive integers"):
        EngineConfig.from_args(cudagraph_capture_sizes=[0, 4])
    with pytest.raises(ValueError, match="must equal the largest of cudagraph_capture_sizes"):
        EngineConfig.from_args(cudagraph_capture_sizes=[1, 8], max_cudagraph_capture_size=16)
    with pytest.raises(ValueError, match="max_cudagraph_capture_size must be positive"):
        EngineConfig.from_args(max_cudagraph_capture_size=0)


def test_enforce_eager_captures_nothing() -> None:
    assert sizes(enforce_eager=True) == []
    assert sizes(enforce_eager=True, cudagraph_capture_sizes=[1, 2]) == []


def test_a_batch_runs_as_the_smallest_size_that_holds_it() -> None:
    assert [padded_size([1, 2, 4, 8], n) for n in (1, 3, 5, 8, 9)] == [1, 4, 8, 8, None]


def test_buffers_pad_with_skipped_slots_and_empty_contexts() -> None:
    b = DecodeBuffers(8, 64, BLOCK, torch.device("cpu"))
    b.fill(4, [11, 12, 13], [0, 17, 40], [[5], [6, 7], [1, 2, 3]])
    meta = b.metadata(4)
    assert b.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert meta.slot_mapping.tolist() == [80, 7 * BLOCK + 1, 3 * BLOCK + 8, -1]
    assert meta.seq_lens.tolist() == [1, 18, 41, 0]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert tuple(meta.block_tables.shape) == (4, 64 // BLOCK)
    assert (meta.max_query_len, meta.max_seq_len) == (1, 64)
    with pytest.raises(ValueError, match="cannot hold position 16"):
        b.fill(2, [1], [16], [[5]])


def test_cpu_gemm_results_repeat_for_one_row_count() -> None:
    """What the same-size case below rests on: one row count, the same bits every time."""
    torch.manual_seed(0)
    w, x = torch.randn(192, 64), torch.randn(8, 64)
    for m in (3, 4, 8):
        assert torch.equal(F.linear(x[:m], w), F.linear(x[:m], w))


@pytest.fixture(scope="module")
def runner(tiny_engine_checkpoints) -> ModelRunner:
    path = tiny_engine_checkpoints["qwen3"].path
    return ModelRunner(EngineConfig.from_args(str(path), dtype="float32", num_gpu_blocks_override=NUM_BLOCKS))


PROMPT_LENS = [5, 17, 9, 30, 3]
TABLES = [[1 + 2 * i, 2 + 2 * i] for i in range(len(PROMPT_LENS))]  # block 0 and 11.. belong to nobody


@pytest.fixture
def prefilled(runner: ModelRunner) -> ModelRunner:
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 384, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    for cache in runner.kv_caches:
        cache.zero_()
    meta = AttentionMetadata.build(PROMPT_LENS, PROMPT_LENS, TABLES, BLOCK)
    with torch.inference_mode():
        runner.model(
            torch.tensor(sum(prompts, [])), torch.cat([torch.arange(n) for n in PROMPT_LENS]), runner.kv_caches, meta
        )
    return runner


@pytest.mark.parametrize(("real", "size"), [(3, 4), (5, 8), (1, 2), (4, 4)])
def test_padded_decode_matches_unpadded_and_writes_no_pad_kv(prefilled: ModelRunner, real: int, size: int) -> None:
    runner = prefilled
    owned = {b for t in TABLES[:real] for b in t}
    others = [b for b in range(NUM_BLOCKS) if b not in owned]
    for cache in runner.kv_caches:
        cache[:, others] = float("nan")
    snapshot = [c.clone() for c in runner.kv_caches]
    ids, positions, tables = [7 + i for i in range(real)], PROMPT_LENS[:real], TABLES[:real]
    meta = AttentionMetadata.build([1] * real, [p + 1 for p in positions], tables, BLOCK)
    with torch.inference_mode():
        plain = runner.model(torch.tensor(ids), torch.tensor(positions), runner.kv_caches, meta)
        written = [c.clone() for c in runner.kv_caches]
        padded = runner.decode_padded(ids, positions, tables, size)
        plain_logits, padded_logits = runner.model.compute_logits(plain), runner.model.compute_logits(padded)
    assert padded.shape == plain.shape
    assert torch.equal(padded_logits.argmax(-1), plain_logits.argmax(-1))
    if real == size:
        assert torch.equal(padded, plain)
    else:
        torch.testing.assert_close(padded_logits, plain_logits, atol=1e-5, rtol=1e-5)
    for cache, before, after_plain in zip(runner.kv_caches, snapshot, written):
        assert torch.isnan(cache[:, others]).all(), "a padding row wrote into a block it does not own"
        changed = ~torch.eq(cache, before) & ~torch.isnan(before)
        changed_plain = ~torch.eq(after_plain, before) & ~torch.isnan(before)
        assert torch.equal(changed.nonzero(), changed_plain.nonzero())  # the same slots written
