"""Gemma on the GPU: the soft-capped Triton attention kernels at Gemma 2's shapes against the
float32 torch reference, and a tiny Gemma 2 (sliding window, attention and final soft-caps) through
the whole engine on CUDA (eager, CUDA graphs, and -O2's torch.compile + graphs) giving the CPU
path's greedy tokens, float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import sonar
from sonar.kernels import reference
from sonar.kernels.triton import paged_attention, paged_decode_attention
from tests.engine.conftest import save_word_tokenizer
from tests.models.test_gemma import save_tiny, tiny_configs
from tests_gpu.cases import AttnShape, PagedBatch, paged_batch

GEMMA2_2B = AttnShape("gemma-2-2b", 8, 4, 256)
#: a cap the random scores pass (transformers' Gemma 2 uses 50 on its trained scores)
CAP = 2.0
TOL = 2e-2


def _capped_reference(batch: PagedBatch, window: int | None) -> torch.Tensor:
    return reference.paged_attention(
        batch.query.float(), batch.cache.float(), batch.meta, batch.scale, window, softcap=CAP
    )


@pytest.mark.parametrize("num_splits", [None, 1, 8])
def test_softcap_decode_gemma2_shapes(num_splits: int | None) -> None:
    seq_lens = torch.randint(1, 2049, (32,)).tolist()
    b = paged_batch(GEMMA2_2B, [1] * 32, seq_lens)
    b.query.mul_(8)
    got = paged_decode_attention(
        b.query,
        b.cache,
        b.meta.block_tables,
        b.meta.seq_lens,
        b.scale,
        b.meta.max_seq_len,
        1024,
        num_splits=num_splits,
        softcap=CAP,
    )
    torch.testing.assert_close(got.float(), _capped_reference(b, 1024), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("window", [None, 512])
def test_softcap_mixed_batch_gemma2_shapes(window: int | None) -> None:
    b = paged_batch(GEMMA2_2B, [1, 300, 1, 77], [900, 300, 1500, 1100])
    b.query.mul_(8)
    got = paged_attention(b.query, b.cache, b.meta, b.scale, window, softcap=CAP)
    torch.testing.assert_close(got.float(), _capped_reference(b, window), atol=TOL, rtol=TOL)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _greedy(monkeypatch: pytest.MonkeyPatch, path: Path, device: str, **engine_args) -> list[list[int]]:
    monkeypatch.setenv("SONAR_DEVICE", device)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 384, (n,), generator=gen).tolist() for n in (40, 3, 64, 17)]
    params = sonar.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    async with sonar.open(str(path), dtype="float32", num_gpu_blocks_override=64, **engine_args) as llm:
        return [out.token_ids for out in await llm.generate_many(prompts, params)]


@pytest.mark.anyio
async def test_tiny_gemma2_on_gpu_equals_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    save_tiny(tiny_configs()["gemma2"], tmp_path, seed=21)
    save_word_tokenizer(tmp_path, 384)
    cpu = await _greedy(monkeypatch, tmp_path, "cpu", enforce_eager=True)
    eager = await _greedy(monkeypatch, tmp_path, "cuda", enforce_eager=True)
    graphs = await _greedy(monkeypatch, tmp_path, "cuda", cudagraph_capture_sizes=[1, 2, 4], optimization_level=1)
    compiled = await _greedy(monkeypatch, tmp_path, "cuda", cudagraph_capture_sizes=[1, 2, 4])
    assert eager == cpu
    assert graphs == cpu
    assert compiled == cpu
