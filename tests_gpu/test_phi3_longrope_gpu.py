"""LongRoPE on the GPU: the tiny Phi-3 of tests/models/test_phi3_longrope.py (original context 32
of 128 positions) through the whole engine on CUDA, eager, with CUDA graphs (a step holding a
long-factor sequence runs eagerly, the others replay their graph) and with -O2's torch.compile:
short, crossing, at-the-boundary and long prompts in one batch give transformers' greedy tokens and
log-probabilities (float32, within 1e-3)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import sonar
from tests.models.test_phi3_longrope import NEW_TOKENS, assert_equals_transformers, prompts_by_kind, save_phi3

#: the GPU's float32 kernels sum in another order than transformers' on the CPU
GPU_ATOL = 1e-3


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
@pytest.mark.parametrize(
    "engine_args",
    [
        {"enforce_eager": True},
        {"cudagraph_capture_sizes": [1, 2, 4], "optimization_level": 1},
        {"cudagraph_capture_sizes": [1, 2, 4]},
    ],
    ids=["eager", "graphs", "compiled"],
)
async def test_longrope_on_gpu_equals_transformers(
    engine_args: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SONAR_DEVICE", "cuda")
    hf = save_phi3(tmp_path)
    prompts = prompts_by_kind()
    params = sonar.SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=2)
    async with sonar.open(
        str(tmp_path),
        dtype="float32",
        max_num_batched_tokens=16,
        max_num_seqs=4,
        num_gpu_blocks_override=40,
        **engine_args,
    ) as llm:
        assert llm.info.longrope_switch == 32
        outs = await llm.generate_many(list(prompts.values()), params)
    for (name, prompt), out in zip(prompts.items(), outs):
        assert_equals_transformers(hf, prompt, out, name, atol=GPU_ATOL)
