"""Tensor parallelism on GPUs: NCCL's all-reduce and all-gather between ranks, eagerly, with CUDA
graphs (-O1) and with torch.compile + graphs (-O2), and two pipeline stages (eager, as stages
run): greedy tokens and logprobs equal one GPU's, in float32. Needs two GPUs (NCCL takes one rank per device); on a
machine with one, these tests are skipped and the CPU tests (gloo) stand for the shared code."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import sonar

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism on GPUs needs two of them"),
]

TEXTS = ["w5 w17 w33 w2 w9", "w100 w250 w7", "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13", "w42"]
NEW_TOKENS = 24


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _greedy(monkeypatch: pytest.MonkeyPatch, path: Path, **args) -> list[tuple[list[int], list[float]]]:
    monkeypatch.setenv("SONAR_DEVICE", "cuda")
    params = sonar.SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    async with sonar.open(str(path), dtype="float32", num_gpu_blocks_override=128, **args) as llm:
        outs = await llm.generate_many(TEXTS, params)
    return [(o.token_ids, [p.logprob for p in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.parametrize(
    "mode",
    [{"enforce_eager": True}, {"optimization_level": 1}, {}, {"pipeline_parallel_size": 2, "tensor_parallel_size": 1}],
    ids=["eager", "graphs", "compiled", "pp2"],
)
async def test_tp2_on_two_gpus_equals_one(monkeypatch: pytest.MonkeyPatch, checkpoint: Path, mode: dict) -> None:
    """Two ranks (two stages for pp2: NCCL's point-to-point sends) against one."""
    graphs = {} if mode.get("enforce_eager") else {"cudagraph_capture_sizes": [1, 2, 4]}
    one = await _greedy(monkeypatch, checkpoint, enforce_eager=True)
    two = await _greedy(monkeypatch, checkpoint, **{"tensor_parallel_size": 2, **mode, **graphs})
    for (tokens_one, lp_one), (tokens_two, lp_two) in zip(one, two):
        assert tokens_two == tokens_one
        assert max(abs(a - b) for a, b in zip(lp_one, lp_two)) < 1e-3
