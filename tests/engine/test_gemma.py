"""A tiny random-weight Gemma 2 (sliding window shorter than the prompts, attention and final
logit soft-capping) through the whole engine (`sonar.open`, the `LLM` handle): prefix caching on,
chunked prefills and a KV pool small enough that requests are preempted and recomputed; greedy
tokens equal transformers' and logprobs its log-softmax (float32)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import sonar
from tests.engine.conftest import save_word_tokenizer
from tests.models.test_gemma import save_tiny, tiny_configs

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("one_thread")]

NEW_TOKENS = 24
LOGPROBS = 3
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


def _greedy_reference(hf: Any, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    with torch.inference_mode():
        ref = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return ref.sequences[0, len(prompt) :].tolist(), torch.log_softmax(torch.cat(ref.logits).float(), dim=-1)


async def test_gemma2_engine_equals_transformers(tmp_path: Any) -> None:
    hf = save_tiny(tiny_configs()["gemma2"], tmp_path, seed=21)
    save_word_tokenizer(tmp_path, hf.config.vocab_size)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, hf.config.vocab_size, (n,), generator=gen).tolist() for n in (40, 3, 64, 17, 33, 9)]
    prompts.append(prompts[2][:48] + prompts[0][:10])  # shares three 16-token blocks with prompt 2
    params = sonar.SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=LOGPROBS)
    # 12 blocks of 16 tokens for ~430 tokens of context: preemptions; 32 tokens a step: chunked prefills
    async with sonar.open(
        str(tmp_path),
        dtype="float32",
        enable_prefix_caching=True,
        num_gpu_blocks_override=12,
        max_num_batched_tokens=32,
        max_num_seqs=8,
    ) as llm:
        assert llm.info.architecture == "Gemma2ForCausalLM"
        first = await llm.generate(prompts[2], params)
        outs = await llm.generate_many(prompts, params)
        stats = await llm.stats()
    assert stats.num_preemptions > 0, "the small KV pool preempted nothing"
    assert stats.prefix_hits > 0, "nothing was served from the prefix cache"
    assert outs[2].token_ids == first.token_ids
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        tokens, logprobs = _greedy_reference(hf, prompt)
        assert out.token_ids == tokens, f"prompt {i}"
        assert out.logprobs is not None
        for j, pos in enumerate(out.logprobs):
            assert abs(pos.logprob - logprobs[j, pos.token_id].item()) <= LOGPROB_ATOL, (i, j)
            ours = torch.tensor([t.logprob for t in pos.top])
            torch.testing.assert_close(ours, logprobs[j, [t.token_id for t in pos.top]], atol=LOGPROB_ATOL, rtol=0)
