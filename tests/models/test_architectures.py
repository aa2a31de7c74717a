"""Each architecture, as a tiny random-weight transformers checkpoint, through the Sonar loader and
model against transformers' own implementation: greedy tokens equal, logits close (float32)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sonar.models.loader import load_model
from tests.models.conftest import TINY_NAMES
from tests.models.driver import GreedyDriver

# float32 on both sides; the paths differ only in kernels and summation order
ATOL = RTOL = 1e-4
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
    gen = GreedyDriver(loaded.model, torch.float32, num_blocks=128, block_size=4).generate(
        prompts, NEW_TOKENS, prompt_logits=True
    )
    for i, prompt in enumerate(prompts):
        with torch.inference_mode():
            out = tiny.hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                eos_token_id=None,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
            full = tiny.hf(torch.tensor([prompt])).logits[0]
        assert gen.tokens[i] == out.sequences[0, len(prompt) :].tolist(), f"prompt {i}"
        torch.testing.assert_close(gen.logits[i], torch.cat(out.logits).float(), atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(gen.prompt_logits[i], full.float(), atol=ATOL, rtol=RTOL)


def test_mixed_batch_equals_plain_batch(case: Any) -> None:
    """Chunked prefills next to decodes, staggered joins, a prompt alone: the same tokens."""
    _, loaded, prompts = case
    plain = GreedyDriver(loaded.model, torch.float32, num_blocks=128, block_size=4).generate(prompts, NEW_TOKENS)
    mixed = GreedyDriver(loaded.model, torch.float32, num_blocks=128, block_size=4, seed=3).generate(
        prompts, NEW_TOKENS, prefill_chunk=5, join_steps=[2, 0, 1, 4]
    )
    assert mixed.tokens == plain.tokens
    for a, b in zip(mixed.logits, plain.logits):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)
    alone = GreedyDriver(loaded.model, torch.float32, num_blocks=32, block_size=4).generate([prompts[2]], NEW_TOKENS)
    assert alone.tokens[0] == plain.tokens[2]
