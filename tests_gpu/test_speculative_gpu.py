"""Speculative decoding on the GPU: a step's drafts run as decode rows, so the CUDA graphs serve the
verification; greedy output with n-gram, suffix and draft-model speculation equals the plain
engine's (four engine starts: the device's minutes are few)."""

from __future__ import annotations

import pytest

import sonar
from sonar.models.embedded import gguf_path

pytestmark = pytest.mark.anyio

EDIT = (
    "Rewrite the following text, replacing 'cat' with 'dog':\n"
    "The cat sat on the mat. The cat was happy. Every morning the cat watched the birds in the garden, "
    "and every evening the cat slept by the fire.\n\nRewritten text:\n"
)
PROMPTS = [EDIT, "def fibonacci(n):", "Once upon a time, in a small village by the sea,"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _greedy(monkeypatch: pytest.MonkeyPatch, **engine_args) -> tuple[list[list[int]], object]:
    monkeypatch.setenv("SONAR_DEVICE", "cuda")
    params = sonar.SamplingParams(max_tokens=48, temperature=0)
    async with sonar.open(dtype="float32", num_gpu_blocks_override=256, **engine_args) as llm:
        outs = [out.token_ids for out in await llm.generate_many(PROMPTS, params)]
        return outs, await llm.stats()


GRAPHS = {"cudagraph_capture_sizes": [1, 2, 4, 8, 16], "optimization_level": 1}


async def test_speculation_keeps_greedy_output_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """ngram and suffix with CUDA graphs (a drafted step is all decode rows: a graph replays it),
    and the embedded model drafting for itself (eager: a draft model turns graphs off), against the
    plain engine with graphs (equal to eager and to the CPU: tests_gpu/test_runner_gpu.py)."""
    plain, _ = await _greedy(monkeypatch, **GRAPHS)
    for config in (NGRAM, {"method": "suffix", "num_speculative_tokens": 8}):
        spec, stats = await _greedy(monkeypatch, speculative_config=config, **GRAPHS)
        assert spec == plain, config
        assert stats.spec_num_accepted_tokens > 0
    config = {"method": "draft_model", "model": str(gguf_path()), "num_speculative_tokens": 3}
    spec, stats = await _greedy(monkeypatch, enforce_eager=True, speculative_config=config)
    assert spec == plain
    assert stats.spec_num_accepted_tokens >= 0.9 * stats.spec_num_draft_tokens > 0
