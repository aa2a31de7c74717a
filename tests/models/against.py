"""A Sonar model against transformers' implementation of the same weights, as every family's
tests check it: greedy tokens equal, logits within a tolerance (float32), and the same tokens
whether prompts prefill whole or in chunks beside other sequences' decodes."""

from __future__ import annotations

from typing import Any

import torch

from tests.models.driver import GreedyDriver

#: float32 on both sides; the paths differ only in kernels and summation order
ATOL = RTOL = 1e-4


def transformers_greedy(hf: Any, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """transformers' `n` greedy tokens after `prompt` and the float32 logits ``[n, vocab]`` each
    was picked from."""
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits).float()


def assert_greedy_equals_transformers(model: Any, hf: Any, prompts: list[list[int]], new_tokens: int) -> None:
    """Sonar's greedy tokens, their logits and every prompt token's logits equal transformers'."""
    gen = GreedyDriver(model, torch.float32, num_blocks=128, block_size=4).generate(
        prompts, new_tokens, prompt_logits=True
    )
    for i, prompt in enumerate(prompts):
        tokens, logits = transformers_greedy(hf, prompt, new_tokens)
        with torch.inference_mode():
            full = hf(torch.tensor([prompt])).logits[0]
        assert gen.tokens[i] == tokens, f"prompt {i}"
        torch.testing.assert_close(gen.logits[i], logits, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(gen.prompt_logits[i], full.float(), atol=ATOL, rtol=RTOL)


def assert_mixed_batch_equals_plain_batch(model: Any, prompts: list[list[int]], new_tokens: int) -> None:
    """Chunked prefills next to decodes, staggered joins, a prompt alone: the same tokens and logits."""
    plain = GreedyDriver(model, torch.float32, num_blocks=128, block_size=4).generate(prompts, new_tokens)
    mixed = GreedyDriver(model, torch.float32, num_blocks=128, block_size=4, seed=3).generate(
        prompts, new_tokens, prefill_chunk=5, join_steps=[2, 0, 1, 4]
    )
    assert mixed.tokens == plain.tokens
    for a, b in zip(mixed.logits, plain.logits):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)
