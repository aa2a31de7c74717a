"""LLaVA on the GPU: a tiny LLaVA through the whole engine on CUDA (eager, CUDA graphs, and -O2's
torch.compile + graphs; image steps always run eagerly) gives the CPU path's greedy tokens for
image prompts, float32, with prefills in chunks that cut through the images' rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import sonar
from tests.multimodal.tiny_llava import IMAGE_TOKEN_ID, random_image, save_tiny_llava


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _greedy(monkeypatch: pytest.MonkeyPatch, path: Path, device: str, **engine_args) -> list[list[int]]:
    monkeypatch.setenv("SONAR_DEVICE", device)
    params = sonar.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = [[3, IMAGE_TOKEN_ID, 4, 5], [6, IMAGE_TOKEN_ID, 7, IMAGE_TOKEN_ID, 8], [9, 10, 11]]
    pictures = [[random_image(1)], [random_image(2), random_image(3)], []]
    async with sonar.open(
        str(path), dtype="float32", num_gpu_blocks_override=64, max_num_batched_tokens=24, max_num_seqs=4, **engine_args
    ) as llm:
        outs = []
        for ids, pics in zip(prompts, pictures):
            if pics:
                ids, images = await llm.add_images(ids, pics)
            else:
                images = []
            outs.append((await llm.generate(ids, params, images=images)).outputs[0].token_ids)
        return outs


@pytest.mark.anyio
async def test_tiny_llava_on_gpu_equals_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    save_tiny_llava(tmp_path, seed=5)
    cpu = await _greedy(monkeypatch, tmp_path, "cpu", enforce_eager=True)
    eager = await _greedy(monkeypatch, tmp_path, "cuda", enforce_eager=True)
    graphs = await _greedy(monkeypatch, tmp_path, "cuda", cudagraph_capture_sizes=[1, 2, 4], optimization_level=1)
    compiled = await _greedy(monkeypatch, tmp_path, "cuda", cudagraph_capture_sizes=[1, 2, 4])
    assert eager == cpu and graphs == cpu and compiled == cpu
    assert torch.cuda.is_available()
