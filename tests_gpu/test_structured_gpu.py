"""Structured outputs on the GPU: xgrammar's CUDA kernel masks exactly what the CPU path masks,
and the engine (async scheduling on, the default on CUDA, with CUDA graphs) yields JSON that
validates, the same as on the CPU for greedy decoding."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

import sonar
from sonar.sampling_params import StructuredOutputsParams
from sonar.structured.bitmask import apply_token_bitmask, pack_allowed

pytestmark = pytest.mark.anyio

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cuda_kernel_masks_what_the_cpu_path_masks(dtype: torch.dtype) -> None:
    vocab, rows = 49152, 16
    logits = torch.randn(rows, vocab, dtype=dtype)
    allowed = torch.rand(8, vocab) < 0.1
    packed = pack_allowed(allowed)
    targets = [15, 0, 3, 7, 8, 2, 11, 5]
    cpu = logits.clone()
    apply_token_bitmask(cpu, packed, targets)
    gpu = logits.cuda()
    apply_token_bitmask(gpu, packed, targets)
    assert torch.equal(gpu.cpu(), cpu)


async def _json(monkeypatch: pytest.MonkeyPatch, device: str, **engine_args) -> list[str]:
    monkeypatch.setenv("SONAR_DEVICE", device)
    params = sonar.SamplingParams(max_tokens=96, temperature=0, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    prompts = [f"Describe person number {i} as JSON:" for i in range(16)]
    async with sonar.open(dtype="float32", num_gpu_blocks_override=512, **engine_args) as llm:
        outs = await llm.generate_many(prompts, params)
    for out in outs:
        if out.finish_reason != "length":
            jsonschema.validate(json.loads(out.text), SCHEMA)
    return [out.text for out in outs]


async def test_json_on_gpu_validates_and_equals_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = await _json(monkeypatch, "cpu", enforce_eager=True)
    gpu = await _json(monkeypatch, "cuda", cudagraph_capture_sizes=[1, 2, 4, 8, 16], optimization_level=1)
    assert gpu == cpu
