"""Each architecture, as a tiny random-weight transformers checkpoint, through the Sonar loader and
model against transformers' own implementation: greedy tokens equal, logits close (float32)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sonar.models.loader import load_model
from tests.models.against import assert_greedy_equals_transformers, assert_mixed_batch_equals_plain_batch
from tests.models.conftest import TINY_NAMES

NEW_TOKENS = 20
EXPECTED_CLASS = {
    "llama3": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "glm4": "Glm4ForCausalLM",
}


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in (3, 17, 40, 9)]


@pytest.fixture(scope="module", params=TINY_NAMES)
def case(request: pytest.FixtureRequest, tiny_checkpoints: dict[str, Any]) -> tuple[Any, Any, list[list[int]]]:
    tiny = tiny_checkpoints[request.param]
    loaded = load_model(str(tiny.path), dtype="float32")
    return tiny, loaded, _prompts(loaded.config.vocab_size)


def test_loads_as_its_architecture(case: Any) -> None:
    tiny, loaded, _ = case
    assert loaded.architecture == EXPECTED_CLASS[tiny.name]
    assert loaded.dtype == torch.float32
    assert loaded.tokenizer_path is None
    hf_params = dict(tiny.hf.named_parameters())
    ours = dict(loaded.model.named_parameters())
    assert torch.equal(ours["model.norm.weight"], hf_params["model.norm.weight"])


def test_greedy_tokens_and_logits_equal_transformers(case: Any) -> None:
    tiny, loaded, prompts = case
    assert_greedy_equals_transformers(loaded.model, tiny.hf, prompts, NEW_TOKENS)


def test_mixed_batch_equals_plain_batch(case: Any) -> None:
    """Chunked prefills next to decodes, staggered joins, a prompt alone: the same tokens."""
    _, loaded, prompts = case
    assert_mixed_batch_equals_plain_batch(loaded.model, prompts, NEW_TOKENS)
