"""Shared, expensive fixtures of the model tests: real weights, loaded once per session."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from tests.models.rank_pool import RankPool

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three colors:",
    "Water boils at",
    "The quick brown fox",
    "Explain photosynthesis in one sentence.",
    "1, 2, 3, 4,",
]


@dataclass
class Tiny:
    """A random-weight checkpoint saved by transformers, and the transformers model it came from."""

    name: str
    path: Path
    hf: Any


#: Phi-3's LongRoPE over a 12-dim rotary (6 frequencies), factors that differ per frequency
PHI3_LONGROPE = {
    "type": "longrope",
    "short_factor": [1.0, 1.1, 1.25, 1.5, 1.8, 2.0],
    "long_factor": [2.0, 3.0, 5.0, 8.0, 12.0, 16.0],
}


def _tiny_configs() -> dict[str, Any]:
    from transformers import (
        Glm4Config,
        GraniteConfig,
        LlamaConfig,
        MistralConfig,
        Olmo2Config,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )

    common = dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    return {
        # Llama 3 rope scaling with a short original context, so all three wavelength bands occur
        "llama3": LlamaConfig(
            **common,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            architectures=["LlamaForCausalLM"],
        ),
        # q/k RMSNorm per head, head_dim decoupled from hidden_size / heads, YaRN, tied embeddings
        "qwen3": Qwen3Config(
            **common,
            head_dim=32,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            architectures=["Qwen3ForCausalLM"],
        ),
        # biases on q/k/v
        "qwen2": Qwen2Config(**common, architectures=["Qwen2ForCausalLM"]),
        # a sliding window shorter than the prompts
        "mistral": MistralConfig(**common, sliding_window=8, architectures=["MistralForCausalLM"]),
        # fused qkv/gate_up in the checkpoint; LongRoPE's short factors and attention factor
        # (max_position_embeddings / original = 4), over the first 3/4 of each head (Phi-4-mini)
        "phi3": Phi3Config(
            **common,
            partial_rotary_factor=0.75,
            original_max_position_embeddings=64,
            rope_scaling=PHI3_LONGROPE,
            architectures=["Phi3ForCausalLM"],
        ),
        # the four multipliers, biases everywhere, dynamic NTK scaling
        "granite": GraniteConfig(
            **common,
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.2,
            logits_scaling=2.5,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
            architectures=["GraniteForCausalLM"],
        ),
        # post-norms, q/k norms over all heads, linear rope scaling
        "olmo2": Olmo2Config(
            **common,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
            architectures=["Olmo2ForCausalLM"],
        ),
        # post-attention/post-MLP norms, half of each head rotated in interleaved pairs, q/k/v biases
        "glm4": Glm4Config(**common, head_dim=16, architectures=["Glm4ForCausalLM"]),
    }


TINY_NAMES = tuple(_tiny_configs())


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tiny]:
    from transformers import AutoModelForCausalLM

    out = {}
    for i, (name, config) in enumerate(_tiny_configs().items()):
        torch.manual_seed(i)
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        with torch.no_grad():  # spread every weight (zero-initialized biases and unit norms too)
            for pname, param in hf.named_parameters():
                if pname.endswith("norm.weight"):
                    param.copy_(1 + 0.2 * torch.randn_like(param))
                else:
                    param.copy_(0.15 * torch.randn_like(param))
        path = tmp_path_factory.mktemp(name)
        hf.save_pretrained(str(path))
        out[name] = Tiny(name, path, hf)
    return out


@pytest.fixture(scope="session")
def rank_pool() -> Iterator[RankPool]:
    """The rank processes of every gloo world the model tests run, started once per session."""
    pool = RankPool()
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def smollm2_fp32() -> Any:
    from sonar.models.loader import load_model

    return load_model(None, dtype="float32", dequantize_weights=True)


@pytest.fixture(scope="session")
def smollm2_prompts(smollm2_fp32: Any) -> tuple[list[str], list[list[int]]]:
    """Half plain text, half rendered with the chat template; lengths 3 to ~40 tokens."""
    tok = smollm2_fp32.load_tokenizer()
    texts = [
        tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
        if i % 2
        else t
        for i, t in enumerate(TEXTS)
    ]
    return texts, [tok(t).input_ids for t in texts]


def hf_generate_batch(
    hf: Any, tokenizer: Any, texts: list[str], max_new_tokens: int
) -> tuple[list[list[int]], torch.Tensor]:
    """transformers' greedy generation for a left-padded batch, never stopping early.

    Returns the new tokens per prompt and the logits ``[steps, batch, vocab]`` they came from.
    """
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    hf.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = hf.generate(
            **batch,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
    new = out.sequences[:, batch.input_ids.shape[1] :].tolist()
    return new, torch.stack(out.logits).float()
