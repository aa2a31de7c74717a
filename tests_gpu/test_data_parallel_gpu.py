"""Data-parallel replicas on CUDA (`sonar.engine.replicas.on_replica_gpus`): two replicas answer
with one engine's greedy text. On one GPU they share it, each with half of
``--gpu-memory-utilization`` (the second could not start with the whole of it); on two or more,
replica 1's worker takes GPU 1, whose free memory falls by its KV cache and weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import sonar

pytestmark = pytest.mark.anyio

TEXTS = ["w5 w17 w33 w2 w9", "w100 w250 w7", "w1 w2 w3 w4 w5 w6 w7 w8", "w42"]
PARAMS = sonar.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _texts(path: Path, **args) -> list[str]:
    async with sonar.open(str(path), dtype="float32", gpu_memory_utilization=0.9, **args) as llm:
        return [o.text for o in await llm.generate_many(TEXTS, PARAMS)]


async def test_two_replicas_take_their_gpus_and_answer_as_one_engine(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SONAR_DEVICE", "cuda")
    want = await _texts(checkpoint)
    torch.cuda.empty_cache()  # that engine's worker ran in this process: give its cache back
    if torch.cuda.device_count() >= 2:
        free_before = torch.cuda.mem_get_info(1)[0]
        async with sonar.open(
            str(checkpoint), dtype="float32", gpu_memory_utilization=0.5, data_parallel_size=2
        ) as llm:
            used_on_1 = free_before - torch.cuda.mem_get_info(1)[0]
            got = [o.text for o in await llm.generate_many(TEXTS, PARAMS)]
        # replica 1's KV cache alone is most of half the GPU
        assert used_on_1 > 0.3 * torch.cuda.mem_get_info(1)[1]
    else:
        got = await _texts(checkpoint, data_parallel_size=2)
    assert got == want
