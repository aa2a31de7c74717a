"""Prompt embeddings on the GPU: a step with embedding rows runs eagerly beside the compiled
forms and CUDA graphs of token steps, so the embeddings of a prompt's tokens give the token
prompt's greedy output with graphs on (the model's dtype differs from the float32 the embeddings
travel in: bfloat16 here)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import sonar
from tests.http.test_admin import save_tiny_llama

pytestmark = pytest.mark.anyio

PROMPT = " ".join(f"w{i}" for i in (5, 17, 300, 9, 41, 77, 12, 200, 3, 64, 90, 150, 33, 8, 270, 19))


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_embeddings_equal_tokens_with_cuda_graphs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    tiny = save_tiny_llama(tmp_path / "tiny")
    layer = AutoModelForCausalLM.from_pretrained(str(tiny)).get_input_embeddings()
    monkeypatch.setenv("SONAR_DEVICE", "cuda")
    params = sonar.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    async with sonar.open(
        str(tiny), dtype="bfloat16", enable_prompt_embeds=True, num_gpu_blocks_override=64,
        cudagraph_capture_sizes=[1, 2, 4], optimization_level=1,
    ) as llm:  # fmt: skip
        ids = await llm.tokenize(PROMPT)
        by_ids = await llm.generate(ids, params)
        embeds = layer(torch.tensor(ids)).detach().to(torch.bfloat16).float()  # the values the model holds
        by_embeds = await llm.generate({"prompt_embeds": embeds}, params)
    assert by_embeds.outputs[0].token_ids == by_ids.outputs[0].token_ids
