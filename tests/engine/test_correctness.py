"""End-to-end correctness of the engine (`sonar.open`): real models, real actors, no mocks.

* Greedy tokens equal transformers' `generate(do_sample=False)` on the same weights (the
  embedded SmolLM2-135M-Instruct, and tiny random-weight Llama 3 / Qwen3 / Qwen2 / Mistral
  checkpoints built at test time), and Sonar's logprobs are transformers' log-softmax.
* Batch invariance: a prompt's greedy output is the same alone and inside a batch of 16
  mixed-length prompts, also when a tiny token budget chunks the prefills and when a tiny KV
  cache forces preemptions (the tiny Llama also with the worker in a child process); every
  KV block is free again afterwards.
* `prompt_logprobs` survive chunked prefills and preemptions and equal transformers'.
* A repeated long prompt is served from the prefix cache and gives the same output.

Every engine runs in float32, so the only differences from transformers are kernels and
summation order. Engines cannot share a process with each other (actor names are per process),
so each scenario opens its own, one at a time.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import sonar
from tests.engine.conftest import TinyCheckpoint
from tests.models.conftest import TEXTS, hf_generate_batch

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("one_thread")]

# -- tolerances on logprobs (natural log), float32 against float32 -------------------------------
#: SmolLM2: the model tests hold its logits to 2e-3 + 1e-4 * |logit| (logits are O(10-30));
#: the logprobs agree far better than that. Measured here: at most 3e-5.
SMOL_LOGPROB_ATOL = 1e-3
#: Tiny models (hidden size 64). Measured here: at most 5e-6.
TINY_LOGPROB_ATOL = 1e-4

#: Every prompt crosses two or more KV blocks (16 tokens) while generating.
SMOL_NEW_TOKENS = 32
SMOL_LOGPROBS = 5
TINY_NEW_TOKENS = 24
TINY_LOGPROBS = 5
#: Batch invariance: tokens per request (alone runs are one request at a time, so they cost
#: 16 x this many SmolLM2 steps).
INVARIANCE_TOKENS = {"smollm2": 10, "llama3": 32}
#: SmolLM2 prompts of 1 to ~75 tokens; the odd ones go through the chat template.
MORE_TEXTS = [
    "Hi",
    "Write a haiku about autumn leaves falling into a quiet river at dusk.",
    "Translate to French: I would like a cup of coffee and a croissant, please.",
    "The history of the Roman Empire spans more than a thousand years. It began with the founding of Rome, "
    "grew through the Republic, and reached its greatest extent under Trajan. Summarize the main reasons for "
    "its decline:",
    "Q: What is 17 times 23?\nA:",
    'import numpy as np\n\ndef normalize(x):\n    """Scale the rows of x to unit length."""\n',
    "Dear hiring manager, I am writing to apply for the position of senior software engineer at your company. "
    "I have ten years of experience building distributed systems, and",
    "Photosynthesis, respiration, and fermentation are three ways that living things handle energy. Compare "
    "them in a short table with one row per process and columns for inputs, outputs, and where it happens in "
    "the cell.",
]
#: The batch scenarios: engine arguments on top of float32.
SCENARIOS: dict[str, dict[str, Any]] = {
    # 256 blocks hold all 16 requests at once (the default cache, 2 GiB, only costs time to set up)
    "batch": {"num_gpu_blocks_override": 256},
    # one step holds 32 tokens: every prompt longer than that is prefilled in chunks, next to decodes
    "chunked": {"max_num_batched_tokens": 32, "max_num_seqs": 16, "num_gpu_blocks_override": 256},
    # 16 blocks of 16 tokens for 16 requests of up to ~150 tokens: requests are preempted and recomputed
    "preempt": {"num_gpu_blocks_override": 16},
}
#: Tiny models are cheap enough for one more: preemptions with the worker in a child process
#: (so every step, its sampling parameters and its results cross a process boundary).
TINY_SCENARIOS: dict[str, dict[str, Any]] = {
    **SCENARIOS,
    "preempt-worker-process": {"num_gpu_blocks_override": 16, "placement": "worker=process"},
}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    # module scope, so that module-scoped async fixtures (the alone references) can run
    return "asyncio"


def _chat_or_plain(tokenizer: Any, texts: list[str]) -> list[str]:
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
        if i % 2
        else t
        for i, t in enumerate(texts)
    ]


def _random_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths]


def _greedy(n: int, logprobs: int | None = None) -> sonar.SamplingParams:
    """Greedy, exactly `n` tokens (EOS ignored, as transformers' reference runs never stop early)."""
    return sonar.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=logprobs)


def _assert_logprobs_match(out: sonar.RequestOutput, ref_logprobs: torch.Tensor, num: int, atol: float) -> None:
    """Sonar's logprobs of each generated token, and of its top `num` alternatives, against the
    log-softmax of transformers' logits at the same positions (`ref_logprobs` [steps, vocab])."""
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == ref_logprobs.shape[0]
    for j, (token, pos) in enumerate(zip(out.token_ids, out.logprobs)):
        ref = ref_logprobs[j]
        assert pos.token_id == token
        assert pos.rank == 1, f"step {j}: the greedy token has rank {pos.rank}"
        assert abs(pos.logprob - ref[token].item()) <= atol, (j, pos.logprob, ref[token].item())
        assert len(pos.top) == num
        top_ids = [t.token_id for t in pos.top]
        ours = torch.tensor([t.logprob for t in pos.top])
        # each reported alternative has transformers' logprob for that token ...
        torch.testing.assert_close(ours, ref[top_ids], atol=atol, rtol=0)
        # ... and they are transformers' top `num` (compared by value: near-ties may swap ids)
        torch.testing.assert_close(ours, ref.topk(num).values, atol=atol, rtol=0)
        assert top_ids[0] == token


async def _run_batch(
    model: str | None, prompts: list[list[int]], params: sonar.SamplingParams, **engine_args: Any
) -> tuple[list[sonar.RequestOutput], Any, Any]:
    """Open an engine, generate for all prompts at once, and return outputs, final stats, info."""
    async with sonar.open(model, dtype="float32", **engine_args) as llm:
        outs = await llm.generate_many(prompts, params)
        stats = await llm.stats()
        return outs, stats, llm.info


async def _run_alone(
    model: str | None, prompts: list[list[int]], params: sonar.SamplingParams, **engine_args: Any
) -> list[list[int]]:
    """Each prompt on its own (one request in the engine at a time), without prefix caching."""
    async with sonar.open(model, dtype="float32", enable_prefix_caching=False, **engine_args) as llm:
        return [(await llm.generate(p, params)).token_ids for p in prompts]


def _transformers_greedy(hf: Any, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """transformers' unpadded single-prompt greedy `n` tokens, and their logprobs [n, vocab]."""
    with torch.inference_mode():
        ref = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return ref.sequences[0, len(prompt) :].tolist(), torch.log_softmax(torch.cat(ref.logits).float(), dim=-1)


def _assert_engine_idle(stats: Any, info: Any) -> None:
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.num_free_blocks == info.num_blocks
    assert stats.kv_usage == 0


# -- 1. greedy tokens and logprobs equal transformers -------------------------------------------
async def test_smollm2_greedy_equals_transformers() -> None:
    """8 prompts (plain and chat-templated, 3 to ~40 tokens) x 32 tokens, batched by the engine,
    against transformers' left-padded batch on the same float32 weights. The point here is the
    engine (batching, sampling, logprobs, detokenizing); the model's 64 greedy tokens per prompt
    against transformers' are tests/models/test_smollm2.py's."""
    async with sonar.open(dtype="float32", num_gpu_blocks_override=128, dequantize_weights=True) as llm:
        texts = _chat_or_plain(llm.tokenizer, TEXTS)
        outs = await llm.generate_many(texts, _greedy(SMOL_NEW_TOKENS, SMOL_LOGPROBS))
        # the embedded model's converted checkpoint directory holds its tokenizer too
        model_dir, tokenizer = llm.info.tokenizer_path, llm.tokenizer
    # the engine is closed: transformers may take the CPU (and block the event loop) now
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ref_tokens, ref_logits = hf_generate_batch(hf, tokenizer, texts, SMOL_NEW_TOKENS)
    ref_logprobs = torch.log_softmax(ref_logits, dim=-1)  # [steps, batch, vocab]
    for i, (text, out) in enumerate(zip(texts, outs)):
        assert out.prompt_token_ids == tokenizer(text).input_ids
        assert out.finish_reason == "length"
        assert out.token_ids == ref_tokens[i], f"prompt {i}: {text!r}"
        _assert_logprobs_match(out, ref_logprobs[:, i], SMOL_LOGPROBS, SMOL_LOGPROB_ATOL)
        assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("name", ["llama3", "qwen3", "qwen2", "mistral"])
async def test_tiny_greedy_equals_transformers(name: str, tiny_engine_checkpoints: dict[str, TinyCheckpoint]) -> None:
    """Llama with llama3 rope scaling, Qwen3 (q/k norm, YaRN, tied embeddings), Qwen2 (qkv bias),
    Mistral (sliding window of 8, shorter than most prompts): 6 prompts of 3 to 64 token ids,
    batched, against transformers' unpadded single-prompt generate."""
    tiny = tiny_engine_checkpoints[name]
    prompts = _random_prompts(tiny.hf.config.vocab_size, [3, 17, 40, 9, 33, 64], seed=11)
    outs, stats, info = await _run_batch(
        str(tiny.path), prompts, _greedy(TINY_NEW_TOKENS, TINY_LOGPROBS), num_gpu_blocks_override=64
    )
    assert info.architecture == type(tiny.hf).__name__
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_logprobs = _transformers_greedy(tiny.hf, prompt, TINY_NEW_TOKENS)
        assert out.token_ids == ref_tokens
        _assert_logprobs_match(out, ref_logprobs, TINY_LOGPROBS, TINY_LOGPROB_ATOL)
    _assert_engine_idle(stats, info)


# -- 2. batch invariance ------------------------------------------------------------------------
@pytest.fixture(scope="module")
async def smollm2_alone() -> tuple[list[list[int]], list[list[int]]]:
    """16 SmolLM2 prompts of 1 to ~75 tokens, and each one's greedy output generated alone."""
    params = _greedy(INVARIANCE_TOKENS["smollm2"])
    async with sonar.open(dtype="float32", enable_prefix_caching=False, num_gpu_blocks_override=64) as llm:
        prompts = [llm.tokenizer(t).input_ids for t in _chat_or_plain(llm.tokenizer, TEXTS + MORE_TEXTS)]
        alone = [(await llm.generate(p, params)).token_ids for p in prompts]
    return prompts, alone


@pytest.fixture(scope="module")
async def llama3_alone(tiny_engine_checkpoints: dict[str, TinyCheckpoint]) -> tuple[list[list[int]], list[list[int]]]:
    """16 tiny-Llama prompts of 1 to 120 token ids, and each one's greedy output generated alone."""
    lengths = [5, 36, 13, 120, 1, 34, 64, 41, 2, 45, 20, 74, 15, 53, 31, 90]
    tiny = tiny_engine_checkpoints["llama3"]
    prompts = _random_prompts(tiny.hf.config.vocab_size, lengths, seed=5)
    path = str(tiny.path)
    alone = await _run_alone(path, prompts, _greedy(INVARIANCE_TOKENS["llama3"]), num_gpu_blocks_override=64)
    return prompts, alone


async def _check_invariance(
    model: str | None,
    prompts: list[list[int]],
    alone: list[list[int]],
    n: int,
    scenario: str,
    engine_args: dict[str, Any],
) -> None:
    if "max_num_batched_tokens" in engine_args:
        assert max(map(len, prompts)) > 2 * engine_args["max_num_batched_tokens"]
    outs, stats, info = await _run_batch(model, prompts, _greedy(n), **engine_args)
    for i, (out, ref) in enumerate(zip(outs, alone)):
        assert len(out.token_ids) == n and out.finish_reason == "length"
        assert out.token_ids == ref, f"prompt {i} ({len(prompts[i])} tokens) differs from its run alone"
    if scenario.startswith("preempt"):
        assert stats.num_preemptions > 0
    _assert_engine_idle(stats, info)


@pytest.mark.parametrize("scenario", SCENARIOS)
async def test_smollm2_batch_invariance(scenario: str, smollm2_alone: Any) -> None:
    prompts, alone = smollm2_alone
    await _check_invariance(None, prompts, alone, INVARIANCE_TOKENS["smollm2"], scenario, SCENARIOS[scenario])


@pytest.mark.parametrize("scenario", TINY_SCENARIOS)
async def test_tiny_llama3_batch_invariance(
    scenario: str, llama3_alone: Any, tiny_engine_checkpoints: dict[str, TinyCheckpoint]
) -> None:
    prompts, alone = llama3_alone
    path = str(tiny_engine_checkpoints["llama3"].path)
    await _check_invariance(path, prompts, alone, INVARIANCE_TOKENS["llama3"], scenario, TINY_SCENARIOS[scenario])


@pytest.mark.parametrize("scenario", ["chunked", "preempt"])
async def test_tiny_prompt_logprobs_equal_transformers(
    scenario: str, llama3_alone: Any, tiny_engine_checkpoints: dict[str, TinyCheckpoint]
) -> None:
    """`prompt_logprobs` of 16 prompts (1 to 120 tokens) prefilled in chunks of a 32-token budget
    or preempted and recomputed, then of the longest one alone: one entry per prompt token (None
    for the first), each equal to transformers' log-softmax of the full-prompt forward pass."""
    tiny = tiny_engine_checkpoints["llama3"]
    prompts, _ = llama3_alone
    num = 2
    params = sonar.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=num)
    async with sonar.open(str(tiny.path), dtype="float32", **SCENARIOS[scenario]) as llm:
        outs = await llm.generate_many(prompts, params)
        # the longest prompt once more, alone: then some steps hold nothing but its prefill chunk
        longest = max(prompts, key=len)
        outs.append(await llm.generate(longest, params))
        prompts = [*prompts, longest]
        stats, info = await llm.stats(), llm.info
    if scenario == "preempt":
        assert stats.num_preemptions > 0
    _assert_engine_idle(stats, info)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        with torch.inference_mode():
            ref = torch.log_softmax(tiny.hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
        plps = out.prompt_logprobs
        assert plps is not None and len(plps) == len(prompt), (i, len(plps or []), len(prompt))
        assert plps[0] is None
        for t in range(1, len(prompt)):
            pos, row = plps[t], ref[t - 1]  # row t-1 predicts token t
            assert pos is not None and pos.token_id == prompt[t]
            value = row[prompt[t]].item()
            assert abs(pos.logprob - value) <= TINY_LOGPROB_ATOL, (i, t, pos.logprob, value)
            higher = int((row > value + TINY_LOGPROB_ATOL).sum())
            close = int(((row - value).abs() <= TINY_LOGPROB_ATOL).sum()) - 1
            assert higher + 1 <= pos.rank <= higher + 1 + close
            ours = torch.tensor([a.logprob for a in pos.top])
            torch.testing.assert_close(ours, row.topk(num).values, atol=TINY_LOGPROB_ATOL, rtol=0)
            torch.testing.assert_close(ours, row[[a.token_id for a in pos.top]], atol=TINY_LOGPROB_ATOL, rtol=0)


# -- 3. prefix caching --------------------------------------------------------------------------
async def test_repeated_prefix_is_served_from_the_prefix_cache() -> None:
    """A ~250-token prompt (15+ blocks) twice: the second run reads its prefix from the cache and
    gives the same output. The same prefix with another question also hits, and its output
    equals that of a run kept off the cache by a `cache_salt`."""
    document = " ".join(TEXTS + MORE_TEXTS[3:])
    params = _greedy(8)
    async with sonar.open(dtype="float32", num_gpu_blocks_override=128) as llm:
        block = llm.info.block_size
        first_prompt = llm.tokenizer(f"{document}\n\nQuestion: which city was named first?\nAnswer:").input_ids
        assert len(first_prompt) > 12 * block
        before = await llm.stats()
        first = await llm.generate(first_prompt, params)
        after_first = await llm.stats()
        second = await llm.generate(first_prompt, params)
        after_second = await llm.stats()

        other_prompt = llm.tokenizer(f"{document}\n\nQuestion: what does the code do?\nAnswer:").input_ids
        other_salted = await llm.generate(other_prompt, params, cache_salt="cold")
        other = await llm.generate(other_prompt, params)
        _assert_engine_idle(await llm.stats(), llm.info)

    assert first.num_cached_tokens == 0
    assert after_first.prefix_hits == before.prefix_hits
    # all full blocks but the one holding the last prompt token (it must be computed for logits)
    assert second.num_cached_tokens == (len(first_prompt) - 1) // block * block
    assert after_second.prefix_hits - after_first.prefix_hits == second.num_cached_tokens
    assert second.token_ids == first.token_ids and second.text == first.text

    shared = next(i for i, (a, b) in enumerate(zip(first_prompt, other_prompt)) if a != b)
    assert other_salted.num_cached_tokens == 0
    assert other.num_cached_tokens == shared // block * block > 0
    assert other.token_ids == other_salted.token_ids
