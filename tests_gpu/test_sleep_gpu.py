"""Sleep mode and the profiler on the GPU: level 1 moves the weights to host memory and frees the
KV cache, level 2 drops the weights; the device memory this process holds drops by what was
freed, and after waking (CUDA graphs captured again over the new cache) the greedy answers are
the ones before. The profiler's table is sorted by CUDA time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import sonar

pytestmark = pytest.mark.anyio

GiB = 2**30
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
PARAMS = sonar.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_sleep_frees_device_memory_and_wake_restores_the_answers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SONAR_DEVICE", "cuda")
    profiler = {"profiler": "torch", "torch_profiler_dir": str(tmp_path), "torch_profiler_use_gzip": False}
    async with sonar.open(
        dtype="float32",
        kv_cache_memory_bytes=GiB,
        cudagraph_capture_sizes=[1, 2, 4],
        optimization_level=1,
        enable_sleep_mode=True,
        profiler_config=profiler,
    ) as llm:
        before = [o.token_ids for o in await llm.generate_many(PROMPTS, PARAMS)]
        for level in (1, 2):
            awake = torch.cuda.memory_allocated()
            await llm.sleep(level)
            freed = awake - torch.cuda.memory_allocated()
            assert freed > GiB + 400 * 2**20, (level, freed)  # the KV cache and ~540 MB of weights
            await llm.wake_up()
            assert [o.token_ids for o in await llm.generate_many(PROMPTS, PARAMS)] == before

        await llm.start_profile()
        await llm.generate(PROMPTS[0], PARAMS)
        files = await llm.stop_profile()
    table = next(f for f in files if f.endswith(".ops.txt"))
    assert "Self CUDA" in Path(table).read_text()
