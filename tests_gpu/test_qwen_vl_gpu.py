"""Qwen2.5-VL, Qwen3-VL and Qwen3-VL MoE on the GPU: a tiny model through the whole engine on CUDA
(eager, CUDA graphs, and -O2's torch.compile + graphs; steps of requests with images run eagerly)
gives the CPU path's greedy tokens for image prompts, float32, with prefills in chunks of 8 that
cut through the images' rows (Qwen3-VL: and through its DeepStack rows; the MoE: its experts
through the Triton grouped GEMM)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import sonar
from tests.multimodal.tiny_llava import random_image
from tests.multimodal.tiny_qwen2_vl import IMAGE_PAD, VISION_END, VISION_START, save_tiny_qwen2_5_vl

IMAGE = [VISION_START, IMAGE_PAD, VISION_END]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _greedy(monkeypatch: pytest.MonkeyPatch, path: Path, device: str, **engine_args) -> list[list[int]]:
    monkeypatch.setenv("SONAR_DEVICE", device)
    params = sonar.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[3, *IMAGE, 4, 5], [6, *IMAGE, 7, *IMAGE, 8], [9, 10, 11]]
    pictures = [[random_image(1, (40, 24))], [random_image(2, (24, 40)), random_image(3, (32, 32))], []]
    async with sonar.open(
        str(path),
        dtype="float32",
        num_gpu_blocks_override=64,
        max_num_batched_tokens=8,
        max_num_seqs=4,
        max_model_len=256,
        limit_mm_per_prompt={"image": 2},
        **engine_args,
    ) as llm:
        outs = []
        for ids, pics in zip(prompts, pictures):
            images = []
            if pics:
                ids, images = await llm.add_images(ids, pics)
            outs.append((await llm.generate(ids, params, images=images)).outputs[0].token_ids)
        return outs


@pytest.mark.anyio
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
async def test_tiny_qwen_vl_on_gpu_equals_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, family: str) -> None:
    save_tiny_qwen2_5_vl(tmp_path, seed=5, family=family)
    cpu = await _greedy(monkeypatch, tmp_path, "cpu", enforce_eager=True)
    eager = await _greedy(monkeypatch, tmp_path, "cuda", enforce_eager=True)
    graphs = await _greedy(monkeypatch, tmp_path, "cuda", cudagraph_capture_sizes=[1, 2, 4], optimization_level=1)
    compiled = await _greedy(monkeypatch, tmp_path, "cuda", cudagraph_capture_sizes=[1, 2, 4])
    assert eager == cpu and graphs == cpu and compiled == cpu
    assert torch.cuda.is_available()


def test_the_memory_profile_runs_the_tower_on_the_largest_image(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The startup profile measures the tower on the largest image (the tiny processor's 64 x 64
    pixels: 64 rows) and keeps the larger peak; --skip-mm-profiling leaves it out."""
    from sonar.engine.config import EngineConfig
    from sonar.engine.runner import ModelRunner

    monkeypatch.setenv("SONAR_DEVICE", "cuda")
    save_tiny_qwen2_5_vl(tmp_path, seed=1)

    def profile(**args: object):
        runner = ModelRunner(
            EngineConfig.from_args(
                str(tmp_path), dtype="float32", max_model_len=256, gpu_memory_utilization=0.3, **args
            )
        )
        assert runner.profile_image() is None or runner.profile_image().length == 64
        return runner.memory_profile

    measured = profile()
    assert measured is not None and measured.tower > 0
    assert measured.peak_activations >= measured.tower
    skipped = profile(skip_mm_profiling=True)
    assert skipped is not None and skipped.tower == 0
