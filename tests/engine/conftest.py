"""Fixtures of the engine tests: tiny random-weight checkpoints that the engine can serve.

The engine needs a tokenizer next to the weights, so each checkpoint gets a word-level
tokenizer whose vocabulary is the model's (token ``i`` is the word ``w<i>``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.models.conftest import _tiny_configs


@dataclass
class TinyCheckpoint:
    name: str
    path: Path
    hf: Any  # the transformers model the checkpoint was saved from (float32, eval mode)


def save_word_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", pad_token="w0").save_pretrained(str(path))


def spread_weights(model: torch.nn.Module) -> None:
    """Random weights spread wide enough that greedy choices are not near-ties (norm weights
    around 1), from torch's current seed."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.15 * torch.randn_like(param))


@pytest.fixture(scope="module")
def tiny_engine_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyCheckpoint]:
    """Each tiny architecture of the model tests (llama3 rope scaling, qwen3, qwen2, mistral),
    saved with random weights spread wide enough that greedy choices are not near-ties."""
    from transformers import AutoModelForCausalLM

    out = {}
    for i, (name, config) in enumerate(_tiny_configs().items()):
        torch.manual_seed(100 + i)
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        spread_weights(hf)
        path = tmp_path_factory.mktemp(f"engine-{name}")
        hf.save_pretrained(str(path))
        save_word_tokenizer(path, config.vocab_size)
        out[name] = TinyCheckpoint(name, path, hf)
    return out


@pytest.fixture(scope="module")
def llama(tiny_engine_checkpoints: dict[str, TinyCheckpoint]) -> TinyCheckpoint:
    """The tiny Llama (4 query heads, 2 KV heads: one KV head per rank of two) that the modules of
    ranks, replicas and nodes serve."""
    return tiny_engine_checkpoints["llama3"]


def greedy_texts(path: Path, prompts: list[str], max_tokens: int) -> list[str]:
    """One engine's greedy texts of `prompts` (float32, one worker, in this process): what a layout
    over ranks, replicas or nodes must reproduce."""
    import asyncio

    import sonar
    from sonar.sampling_params import SamplingParams

    async def run() -> list[str]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        async with sonar.open(str(path), dtype="float32", num_gpu_blocks_override=64) as llm:
            return [o.text for o in await llm.generate_many(prompts, params)]

    return asyncio.run(run())
