"""LoRA on the GPU: the Triton kernels (`sonar/kernels/triton/lora.py`) serve the deltas; greedy
tokens of two adapters and the base model mixed in one engine equal transformers + peft on the
CPU (one engine start: the device's minutes are few)."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch

import sonar
from sonar.models.loader import load_model

pytestmark = pytest.mark.anyio

PROMPTS = ["def fibonacci(n):", "Once upon a time, in a small village by the sea,", "The capital of France is"]
NEW_TOKENS = 16
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _adapters(root: Path) -> tuple[Path, dict[str, Path]]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model_dir = load_model(None, dtype="float32", dequantize_weights=True).model_dir
    out = {}
    for i, rank in enumerate((8, 16)):
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        torch.manual_seed(i)
        peft_model = get_peft_model(
            hf, LoraConfig(r=rank, lora_alpha=16, target_modules=MODULES, init_lora_weights=False)
        )
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.mul_(0.5)
        out[f"r{rank}"] = root / f"r{rank}"
        peft_model.save_pretrained(str(out[f"r{rank}"]))
    return model_dir, out


def _peft_tokens(model_dir: Path, adapter: Path | None, prompts: list[list[int]]) -> list[list[int]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model = hf if adapter is None else PeftModel.from_pretrained(hf, str(adapter)).eval()
    out = []
    with torch.inference_mode():
        for ids in prompts:
            seq = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None)
            out.append(seq[0, len(ids) :].tolist())
    return out


async def test_adapters_mixed_with_the_base_model_equal_peft(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    model_dir, adapters = _adapters(tmp_path)
    monkeypatch.setenv("SONAR_DEVICE", "cuda")
    params = sonar.SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    modules = [f"{name}={path}" for name, path in adapters.items()]
    async with sonar.open(
        dtype="float32", num_gpu_blocks_override=256, enable_lora=True, max_loras=2, lora_modules=modules
    ) as llm:
        prompts = [await llm.tokenize(p) for p in PROMPTS]
        names = [None, *adapters]
        results = {}

        async def run(name: str | None) -> None:
            results[name] = [out.token_ids for out in await llm.generate_many(prompts, params, lora=name)]

        async with anyio.create_task_group() as tg:  # all at once: batches mixing every adapter
            for name in names:
                tg.start_soon(run, name)
    for name in names:
        assert results[name] == _peft_tokens(model_dir, None if name is None else adapters[name], prompts), name
