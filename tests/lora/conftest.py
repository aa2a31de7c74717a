"""Adapters built in the test session with peft (no download): on the embedded SmolLM2 and on a
tiny random Qwen3, each a PEFT folder (adapter_config.json + adapter_model.safetensors)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class Built:
    path: Path
    config: dict[str, Any]


def make_adapter(hf: Any, path: Path, seed: int, b_scale: float = 0.5, **lora: Any) -> Built:
    """Save a LoRA adapter of `hf` (transformers model, left unchanged) with random A and B
    (peft's default init makes B zero: the adapter would change nothing)."""
    from peft import LoraConfig, get_peft_model

    config = dict(r=8, lora_alpha=16, target_modules=ALL_MODULES, init_lora_weights=False) | lora
    torch.manual_seed(seed)
    peft_model = get_peft_model(hf, LoraConfig(**config))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(b_scale)
    peft_model.save_pretrained(str(path))
    peft_model.unload()  # the base model's modules back as they were
    return Built(path, config)


def hf_greedy(hf: Any, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """transformers' greedy continuation of each prompt alone, and the logits of each step."""
    tokens, logits = [], []
    with torch.inference_mode():
        for ids in prompts:
            out = hf.generate(
                torch.tensor([ids]),
                do_sample=False,
                max_new_tokens=new_tokens,
                eos_token_id=None,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
            tokens.append(out.sequences[0, len(ids) :].tolist())
            logits.append(torch.cat(out.logits).float())
    return tokens, logits


def peft_greedy(hf: Any, adapter: Path | None, prompts: list[list[int]], new_tokens: int) -> Any:
    """`hf_greedy` with the PEFT adapter in folder `adapter` applied (None: the base model)."""
    if adapter is None:
        return hf_greedy(hf, prompts, new_tokens)
    from peft import PeftModel

    model = PeftModel.from_pretrained(hf, str(adapter)).eval()
    try:
        return hf_greedy(model, prompts, new_tokens)
    finally:
        model.unload()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded model as a Hugging Face folder (what Sonar's loader converts it to)."""
    from sonar.models.loader import load_model

    return load_model(None, dtype="float32", dequantize_weights=True).model_dir


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_adapters(smollm2_hf: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Built]:
    """Three adapters of the embedded model: plain (r 8), rsLoRA with per-module ranks and alphas
    (r 16, rank 4 on the MLP's down projection), and attention-only (r 4)."""
    root = tmp_path_factory.mktemp("smollm2-adapters")
    return {
        "plain": make_adapter(smollm2_hf, root / "plain", seed=1),
        "rslora": make_adapter(
            smollm2_hf,
            root / "rslora",
            seed=2,
            r=16,
            lora_alpha=8,
            use_rslora=True,
            rank_pattern={"down_proj": 4},
            alpha_pattern={"o_proj": 32},
        ),
        "attention": make_adapter(
            smollm2_hf, root / "attention", seed=3, r=4, lora_alpha=4, target_modules=["q_proj", "v_proj", "o_proj"]
        ),
    }


@dataclass(frozen=True)
class Tiny:
    path: Path
    hf: Any
    adapters: dict[str, Built]


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    """The model tests' random Qwen3 (per-head q/k norms, head_dim apart from hidden / heads, tied
    embeddings, YaRN) saved with a word tokenizer, and two adapters of it: every projection at
    rank 8, and the MLP alone at rank 16 with rsLoRA."""
    from transformers import AutoModelForCausalLM

    from tests.engine.conftest import save_word_tokenizer, spread_weights
    from tests.models.conftest import _tiny_configs

    config = _tiny_configs()["qwen3"]
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    spread_weights(hf)
    root = tmp_path_factory.mktemp("tiny-qwen3")
    hf.save_pretrained(str(root / "model"))
    save_word_tokenizer(root / "model", config.vocab_size)
    adapters = {
        "all": make_adapter(hf, root / "all", seed=11, b_scale=1.0),
        "mlp": make_adapter(
            hf,
            root / "mlp",
            seed=12,
            b_scale=1.0,
            r=16,
            lora_alpha=16,
            use_rslora=True,
            target_modules=["gate_proj", "up_proj", "down_proj"],
        ),
    }
    return Tiny(root / "model", hf, adapters)
