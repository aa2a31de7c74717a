"""The model runner on the GPU: SmolLM2's greedy output through the whole engine (scheduler,
runner, CUDA graphs for decode) equals the CPU path's, in float32; and an fp8 KV cache serves."""

from __future__ import annotations

import pytest

import sonar

pytestmark = pytest.mark.anyio

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three colors:",
]
NEW_TOKENS = 32


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _greedy(monkeypatch: pytest.MonkeyPatch, device: str, **engine_args) -> list[list[int]]:
    monkeypatch.setenv("SONAR_DEVICE", device)
    params = sonar.SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    async with sonar.open(dtype="float32", num_gpu_blocks_override=256, **engine_args) as llm:
        return [out.token_ids for out in await llm.generate_many(PROMPTS, params)]


async def test_smollm2_greedy_on_gpu_equals_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eager, CUDA graphs alone (-O1), and the default -O2 (torch.compile + graphs; a cold compile)."""
    cpu = await _greedy(monkeypatch, "cpu", enforce_eager=True)
    eager = await _greedy(monkeypatch, "cuda", enforce_eager=True)
    graphs = await _greedy(monkeypatch, "cuda", cudagraph_capture_sizes=[1, 2, 4, 8], optimization_level=1)
    compiled = await _greedy(monkeypatch, "cuda", cudagraph_capture_sizes=[1, 2, 4, 8])
    assert eager == cpu
    assert graphs == cpu
    assert compiled == cpu


async def test_fp8_kv_cache_on_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    out = await _greedy(
        monkeypatch, "cuda", kv_cache_dtype="fp8", cudagraph_capture_sizes=[1, 2, 4], optimization_level=1
    )
    assert all(len(tokens) == NEW_TOKENS for tokens in out)


async def test_memory_profiling_sizes_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SONAR_DEVICE", "cuda")
    async with sonar.open(
        dtype="bfloat16", gpu_memory_utilization=0.5, cudagraph_capture_sizes=[1, 2], optimization_level=1
    ) as llm:
        info = llm.info
    assert info.num_blocks > 1000
    assert {"weights", "kv_cache", "graphs", "warmup"} <= set(info.startup_seconds)
