"""GPU-only tests: the Triton kernels compiled for the device, at real model shapes.

Run by ``scripts/gpu_check`` (never by ``scripts/test``, which collects ``tests/`` only). Without a
CUDA device the session stops with an error instead of skipping: a GPU check that did not run is
not a pass.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # before anything imports triton: compile, do not interpret

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    if not torch.cuda.is_available():
        raise pytest.UsageError("tests_gpu needs a CUDA GPU (torch.cuda.is_available() is False)")


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (8 query heads, 2 KV heads: they split over two GPUs) with a word-level
    tokenizer, for the engine tests of several GPUs."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.engine.conftest import save_word_tokenizer, spread_weights

    config = LlamaConfig(
        vocab_size=301,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    spread_weights(hf)
    path = tmp_path_factory.mktemp("llama-gpu")
    hf.save_pretrained(str(path))
    save_word_tokenizer(path, config.vocab_size)
    return path
