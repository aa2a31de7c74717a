"""Speculative decoding with async scheduling on the real embedded model: the text of the plain
synchronous engine.

With ``--async-scheduling`` the worker makes n-gram and suffix drafts into the slots the scheduler
placed as if every draft of the step before were kept (`SchedulerConfig.worker_drafts`). Each case
runs through a small token budget (prompts are prefilled in chunks), and the speculative engines
have a KV cache small enough that a burst is preempted. Greedy output must be identical, and so
must seeded sampling with ``n = 2`` (a seeded request's noise depends only on its output position).
"""

from __future__ import annotations

import anyio
import pytest

import sonar
from sonar import SamplingParams
from tests.engine.test_speculative import CODE, EDIT, NGRAM, STORY

pytestmark = pytest.mark.anyio

COMMON = dict(dtype="float32", max_model_len=256, seed=0, max_num_seqs=8, max_num_batched_tokens=32)
BLOCKS = 24
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4}


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
async def engines(one_thread):
    async with (
        sonar.open(num_gpu_blocks_override=96, **COMMON) as plain,
        sonar.open(num_gpu_blocks_override=BLOCKS, speculative_config=NGRAM, async_scheduling=True, **COMMON) as ngram,
        sonar.open(
            num_gpu_blocks_override=BLOCKS, speculative_config=SUFFIX, async_scheduling=True, **COMMON
        ) as suffix,
    ):
        yield plain, ngram, suffix


async def same_tokens(engines, prompt: str, params: SamplingParams) -> list[sonar.RequestOutput]:
    """Every engine's output for ``prompt``; the speculative ones' tokens are the plain one's."""
    outs = [await llm.generate(prompt, params) for llm in engines]
    expected = [(c.token_ids, c.finish_reason) for c in outs[0].outputs]
    for out in outs[1:]:
        assert [(c.token_ids, c.finish_reason) for c in out.outputs] == expected, (prompt, params)
    return outs


async def test_greedy_text_through_chunked_prefill_and_a_prefix_hit(engines) -> None:
    before = [await llm.stats() for llm in engines[1:]]
    params = SamplingParams(max_tokens=48, temperature=0)
    for prompt in (EDIT, CODE, STORY, EDIT):  # the second edit's prompt is in the prefix cache
        await same_tokens(engines, prompt, params)
    for llm, was in zip(engines[1:], before):
        now = await llm.stats()
        drafts = now.spec_num_draft_tokens - was.spec_num_draft_tokens
        assert 0 < drafts < 2 * (now.spec_num_accepted_tokens - was.spec_num_accepted_tokens)
        assert now.steps_overlapped > was.steps_overlapped  # the loop is async indeed
        assert now.prefix_hits > was.prefix_hits


async def test_seeded_sampling_with_two_choices(engines) -> None:
    params = SamplingParams(n=2, seed=11, temperature=0.8, top_p=0.9, max_tokens=32, presence_penalty=0.3)
    for prompt in (EDIT, CODE):
        await same_tokens(engines, prompt, params)


async def test_stop_strings_and_max_tokens_inside_an_accepted_run(engines) -> None:
    stop = SamplingParams(max_tokens=48, temperature=0, stop=["garden"])
    # the text ends before the stop string; how many tokens past it were sampled before the
    # detokenizer found it depends on timing
    outs = [(await llm.generate(EDIT, stop)).outputs[0] for llm in engines]
    assert [(o.text, o.finish_reason) for o in outs] == [(outs[0].text, "stop")] * 3
    assert "garden" not in outs[0].text
    for max_tokens in (5, 7, 9):  # the edit copies its prompt: most steps keep several drafts
        exact = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        outs = await same_tokens(engines, EDIT, exact)
        assert len(outs[1].outputs[0].token_ids) == max_tokens


async def test_a_burst_is_preempted_and_every_block_comes_back(engines) -> None:
    """Eight edits at once need ~56 blocks of the 24 the speculative engines have: requests with
    drafts in flight are preempted and recomputed."""
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    expected = (await engines[0].generate(EDIT, params)).outputs[0].token_ids
    for llm in engines[1:]:
        before = await llm.stats()
        results: list[list[int]] = []

        async def one(salt: str, llm=llm, results=results) -> None:  # a salt each: no block shared
            results.append((await llm.generate(EDIT, params, cache_salt=salt)).outputs[0].token_ids)

        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(one, f"salt-{i}")
        assert results == [expected] * 8
        after = await llm.stats()
        assert after.num_preemptions > before.num_preemptions
        assert after.spec_num_accepted_tokens > before.spec_num_accepted_tokens
        assert after.num_free_blocks == BLOCKS


async def test_an_abort_with_drafts_in_flight_frees_everything(engines) -> None:
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    params = SamplingParams(max_tokens=24, temperature=0)
    expected = (await engines[0].generate(CODE, params)).outputs[0].token_ids
    for llm in engines[1:]:
        seen = 0
        async for _ in llm.stream(EDIT, long):
            seen += 1
            if seen == 3:
                break
        assert (await llm.generate(CODE, params)).outputs[0].token_ids == expected
        with anyio.fail_after(30):
            while (await llm.stats()).num_running:
                await anyio.sleep(0.05)
        assert (await llm.stats()).num_free_blocks == BLOCKS
        assert await llm.tracked_requests() == {"frontend": 0, "scheduler": 0, "detokenizer": 0}


async def test_a_worker_crash_with_draft_slots_in_flight_loses_no_text(engines) -> None:
    """The steps in flight die with the worker; the new worker's proposer starts empty and the
    requests are recomputed from the tokens the scheduler has."""
    params = SamplingParams(max_tokens=32, temperature=0)
    expected = (await engines[0].generate(CODE, params)).outputs[0].token_ids
    spec = dict(COMMON, num_gpu_blocks_override=BLOCKS, speculative_config=NGRAM, async_scheduling=True)
    async with sonar.open(fault_injection="raise@step=4", **spec) as llm:
        assert (await llm.generate(CODE, params)).outputs[0].token_ids == expected
        worker = next(c for c in llm.tree().children if c.name == "worker")
        assert worker.restarts == 1
        assert (await llm.stats()).spec_num_accepted_tokens > 0
