"""Speculative decoding on the real embedded model: the same text with and without it.

Two float32 engines serve the module, one plain and one with n-gram speculation and a KV cache
small enough that a burst of requests is preempted. Greedy output must be identical; seeded
sampling too (a seeded request's noise depends only on its output position, and the runner
samples every draft's position with the drafts before it as output, `sonar.core.speculative`).
A statistical test checks that verification keeps the target distribution for unseeded sampling.
"""

from __future__ import annotations

import json
import math
from typing import Any

import anyio
import pytest
import torch

import sonar
from sonar import SamplingParams
from sonar.engine.runner import _verify
from sonar.models.embedded import gguf_path
from sonar.models.sampler import Sampler, SamplingBatch

pytestmark = pytest.mark.anyio

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
EDIT = (
    "Rewrite the following text, replacing 'cat' with 'dog':\n"
    "The cat sat on the mat. The cat was happy. Every morning the cat watched the birds in the garden, "
    "and every evening the cat slept by the fire.\n\nRewritten text:\n"
)
CODE = (
    "Add a docstring to this function and return the code:\n"
    "def area(width, height):\n    return width * height\n\n"
    "def perimeter(width, height):\n    return 2 * (width + height)\n"
)
STORY = "Once upon a time, in a small village by the sea,"
PROMPTS = [EDIT, CODE, STORY]


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
async def engines(one_thread):
    common = dict(dtype="float32", max_model_len=256, seed=0)
    async with (
        sonar.open(num_gpu_blocks_override=96, **common) as plain,
        sonar.open(num_gpu_blocks_override=40, speculative_config=NGRAM, **common) as spec,
    ):
        yield plain, spec


async def both(engines, prompt: str, params: SamplingParams) -> tuple[sonar.RequestOutput, sonar.RequestOutput]:
    plain, spec = engines
    return await plain.generate(prompt, params), await spec.generate(prompt, params)


async def test_greedy_text_is_identical_and_drafts_are_accepted(engines) -> None:
    before = await engines[1].stats()
    params = SamplingParams(max_tokens=48, temperature=0)
    for prompt in PROMPTS:
        a, b = await both(engines, prompt, params)
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, prompt
        assert b.outputs[0].text == a.outputs[0].text
    after = await engines[1].stats()
    drafts = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    assert drafts > 0 and accepted > drafts / 2  # the edit and the code repeat their prompts
    assert len(after.spec_accepted_per_position) == 4


async def speculating(plain: sonar.LLM, config: dict, prompts: list[str], *rounds: SamplingParams) -> list[Any]:
    """An engine with speculative `config`: each round's params on each prompt give the plain
    engine's tokens. Its stats after each round."""
    stats = []
    async with sonar.open(
        dtype="float32", max_model_len=256, seed=0, num_gpu_blocks_override=64, speculative_config=config
    ) as spec:
        for params in rounds:
            for prompt in prompts:
                expected = (await plain.generate(prompt, params)).outputs[0].token_ids
                assert (await spec.generate(prompt, params)).outputs[0].token_ids == expected, (prompt, params)
            stats.append(await spec.stats())
    return stats


GREEDY = SamplingParams(max_tokens=24, temperature=0)


async def test_suffix_decoding_gives_the_same_greedy_text(engines, one_thread) -> None:
    """The suffix method on the same prompts, then a second round that its global index of
    finished outputs answers too."""
    config = {"method": "suffix", "num_speculative_tokens": 4}
    *_, stats = await speculating(engines[0], config, [EDIT, CODE], GREEDY, GREEDY)
    assert stats.spec_num_accepted_tokens > stats.spec_num_draft_tokens / 2 > 0


async def test_a_draft_model_the_target_itself_is_always_right(engines, one_thread) -> None:
    """The embedded model as its own draft (a separate copy in the worker, its own KV cache over the
    target's block tables): greedy text unchanged, and every draft accepted but for rounding; seeded
    sampling unchanged too (the drafts, the draft's argmax, are simply kept less often)."""
    config = {"method": "draft_model", "model": str(gguf_path()), "num_speculative_tokens": 3}
    seeded = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=7)
    greedy, _ = await speculating(engines[0], config, [STORY, CODE], GREEDY, seeded)
    assert greedy.spec_num_accepted_tokens >= 0.9 * greedy.spec_num_draft_tokens > 0


async def test_a_tiny_random_draft_model_is_mostly_wrong_and_changes_nothing(engines, one_thread, tmp_path) -> None:
    """A two-layer random Llama with the embedded model's vocabulary: few drafts accepted, the same text."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tiny = LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(tiny).save_pretrained(tmp_path, safe_serialization=True)
    config = {"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 2}
    [stats] = await speculating(engines[0], config, [EDIT, STORY], GREEDY)
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens / 4


async def test_seeded_sampling_with_penalties_is_identical(engines) -> None:
    params = SamplingParams(
        max_tokens=40,
        temperature=0.8,
        top_p=0.95,
        top_k=50,
        repetition_penalty=1.05,
        frequency_penalty=0.1,
        seed=1234,
        n=2,
    )
    for prompt in (EDIT, CODE):
        a, b = await both(engines, prompt, params)
        for x, y in zip(a.outputs, b.outputs):
            assert y.token_ids == x.token_ids
        assert a.outputs[0].token_ids != a.outputs[1].token_ids  # n=2 draws differ by seed position


async def test_logprobs_of_accepted_tokens_match(engines) -> None:
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=3)
    a, b = await both(engines, EDIT, params)
    assert b.outputs[0].token_ids == a.outputs[0].token_ids
    assert len(b.outputs[0].logprobs) == len(b.outputs[0].token_ids) == 24
    for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
        assert (y.token_id, y.rank) == (x.token_id, x.rank)
        assert math.isclose(y.logprob, x.logprob, abs_tol=1e-4)
        assert [t.token_id for t in y.top] == [t.token_id for t in x.top]
        for s, t in zip(x.top, y.top):
            assert math.isclose(s.logprob, t.logprob, abs_tol=1e-4)


async def test_stop_strings_and_max_tokens_cut_speculated_text(engines) -> None:
    stop = SamplingParams(max_tokens=48, temperature=0, stop=["garden"])
    a, b = await both(engines, EDIT, stop)
    assert b.outputs[0].text == a.outputs[0].text and "garden" not in b.outputs[0].text
    assert b.outputs[0].finish_reason == "stop"
    exact = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
    a, b = await both(engines, EDIT, exact)
    assert len(b.outputs[0].token_ids) == 7 and b.outputs[0].token_ids == a.outputs[0].token_ids


async def test_drafts_of_structured_requests_follow_their_grammar(engines) -> None:
    """A JSON object whose values the prompt spells out: the drafts (copied from the prompt) are cut
    to what the grammar allows and each draft row gets its own bitmask; the text is the plain
    engine's and follows the schema."""
    schema = {
        "type": "object",
        "properties": {"animal": {"type": "string"}, "place": {"type": "string"}, "time": {"type": "string"}},
        "required": ["animal", "place", "time"],
        "additionalProperties": False,
    }
    prompt = (
        'Fill in the JSON: {"animal": "cat", "place": "on the mat", "time": "every morning"} and again '
        'the same JSON: {"animal": "cat", "place": "on the mat", "time": "every morning"}. Once more: '
    )
    params = SamplingParams(
        max_tokens=40, temperature=0, structured_outputs={"json": schema, "disable_any_whitespace": True}
    )
    before = await engines[1].stats()
    a, b = await both(engines, prompt, params)
    after = await engines[1].stats()
    assert b.outputs[0].text == a.outputs[0].text
    assert set(json.loads(b.outputs[0].text)) == {"animal", "place", "time"}
    assert after.spec_num_accepted_tokens - before.spec_num_accepted_tokens > 5


async def test_a_burst_is_preempted_and_structured_requests_run_beside_drafts(engines) -> None:
    """Eight edits at once need ~64 blocks of the speculative engine's 40: requests with drafts are
    preempted and recomputed; a structured request among them gets no drafts and keeps its grammar."""
    plain, spec = engines
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    expected = (await plain.generate(EDIT, params)).outputs[0].token_ids
    before = await spec.stats()
    results: list[list[int]] = []
    choice: list[str] = []

    async def one(salt: str) -> None:  # a salt each: no prompt block is shared
        results.append((await spec.generate(EDIT, params, cache_salt=salt)).outputs[0].token_ids)

    async def structured() -> None:
        out = await spec.generate(EDIT, SamplingParams(max_tokens=8, structured_outputs={"choice": ["dog", "cat"]}))
        choice.append(out.outputs[0].text)

    async with anyio.create_task_group() as tg:
        for i in range(8):
            tg.start_soon(one, f"salt-{i}")
        tg.start_soon(structured)
    assert results == [expected] * 8
    assert choice[0] in ("dog", "cat")
    after = await spec.stats()
    assert after.num_preemptions > before.num_preemptions
    assert after.spec_num_accepted_tokens > before.spec_num_accepted_tokens
    assert after.num_free_blocks == 40


async def test_a_worker_crash_with_drafts_in_flight_loses_no_text(one_thread) -> None:
    params = SamplingParams(max_tokens=32, temperature=0)
    common = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=64, seed=0)
    async with sonar.open(**common) as plain:
        expected = (await plain.generate(CODE, params)).outputs[0].text
    async with sonar.open(speculative_config=NGRAM, fault_injection="raise@step=4", **common) as spec:
        out = await spec.generate(CODE, params)
        assert out.outputs[0].text == expected
        worker = next(c for c in spec.tree().children if c.name == "worker")
        assert worker.restarts == 1
        assert (await spec.stats()).spec_num_accepted_tokens > 0


def test_verification_keeps_the_target_distribution() -> None:
    """Sample a 5-token distribution at two positions with two fixed drafts, 20,000 times: the first
    kept token follows p1, and the token after an accepted first draft follows p2 (chi-square)."""
    torch.manual_seed(0)
    logits = torch.tensor([[1.0, 0.2, 2.0, -1.0, 0.5], [0.0, 1.5, -0.5, 1.0, 0.3], [0.1, 0.1, 0.1, 0.1, 0.1]])
    drafts = [2, 1]
    params = SamplingParams(temperature=1.0)
    sampler = Sampler()
    trials = 20_000
    first = torch.zeros(5)
    second = torch.zeros(5)
    for _ in range(trials // 500):
        rows = logits.repeat(500, 1)
        big = SamplingBatch.build([params] * (3 * 500), [[], [2], [2, 1]] * 500, vocab_size=5)
        out = sampler(rows, big)
        tokens = out.sampled_token_ids.tolist()
        failed = out.failed.long().tolist()
        for t in range(500):
            kept = _verify(tokens, failed, 3 * t, drafts)
            first[kept[0]] += 1
            if kept[0] == drafts[0]:
                second[kept[1]] += 1
    for counts, row in ((first, 0), (second, 1)):
        p = torch.softmax(logits[row], dim=-1)
        expected = p * counts.sum()
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 18.47, (row, counts.tolist(), expected.tolist())  # p = 0.001 at 4 degrees of freedom
