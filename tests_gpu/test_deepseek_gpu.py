"""DeepSeek on the GPU: the Triton attention kernels at multi-head latent attention's cache shape
(DeepSeek-V3: 128 query heads over the one latent head of 512 + 64) against the float32 torch
reference, and a tiny DeepSeek-V3 through the whole engine on CUDA (eager, CUDA graphs, and -O2's
torch.compile + graphs) giving the CPU path's greedy tokens, float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import sonar
from sonar.kernels import reference
from sonar.kernels.triton import paged_attention, paged_decode_attention
from tests.engine.conftest import save_word_tokenizer
from tests.models.test_deepseek import _configs, _hf
from tests_gpu.cases import AttnShape, paged_batch

DEEPSEEK_V3_MLA = AttnShape("deepseek-v3-mla", 128, 1, 576)
TOL = 2e-2


def test_latent_decode_deepseek_v3_shape() -> None:
    seq_lens = torch.randint(1, 2049, (16,)).tolist()
    b = paged_batch(DEEPSEEK_V3_MLA, [1] * 16, seq_lens)
    got = paged_decode_attention(b.query, b.cache, b.meta.block_tables, b.meta.seq_lens, b.scale, b.meta.max_seq_len)
    want = reference.paged_attention(b.query.float(), b.cache.float(), b.meta, b.scale)
    torch.testing.assert_close(got.float(), want, atol=TOL, rtol=TOL)


def test_latent_mixed_batch_deepseek_v3_shape() -> None:
    b = paged_batch(DEEPSEEK_V3_MLA, [1, 300, 1, 77], [900, 300, 1500, 1100])
    got = paged_attention(b.query, b.cache, b.meta, b.scale)
    want = reference.paged_attention(b.query.float(), b.cache.float(), b.meta, b.scale)
    torch.testing.assert_close(got.float(), want, atol=TOL, rtol=TOL)


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
async def test_tiny_deepseek_v3_on_gpu_equals_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _hf(_configs()["v3"], seed=21).save_pretrained(str(tmp_path))
    save_word_tokenizer(tmp_path, 384)
    cpu = await _greedy(monkeypatch, tmp_path, "cpu", enforce_eager=True)
    eager = await _greedy(monkeypatch, tmp_path, "cuda", enforce_eager=True)
    graphs = await _greedy(monkeypatch, tmp_path, "cuda", cudagraph_capture_sizes=[1, 2, 4], optimization_level=1)
    compiled = await _greedy(monkeypatch, tmp_path, "cuda", cudagraph_capture_sizes=[1, 2, 4])
    assert eager == cpu
    assert graphs == cpu
    assert compiled == cpu
