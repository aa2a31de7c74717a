"""Multi-step decode through the whole engine (SmolLM2, real worker): with `decode_steps` (on by
default) the worker decodes several tokens per trip, and the tokens, finish reasons, logprobs and
penalties are those of one decode step per trip — answered whole or streamed (each token handed
over as it is sampled, or held back with the result), with stop tokens, `max_tokens`, seeded
sampling, a worker in its own process (its cut over ZMQ) and an injected fault; a request that
arrives during a long multi-step decode cuts it short instead of waiting it out."""

from __future__ import annotations

from functools import partial

import anyio
import pytest

import sonar
from sonar import CompletionOutput, RequestOutput, SamplingParams
from tests.engine.step_loops import ENGINE, GREEDY, PROMPTS, SEEDED

pytestmark = pytest.mark.anyio

PENALIZED = SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3, frequency_penalty=0.5, logprobs=2)
LONG = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
# a stop string ends some inside a run: their tokens and logprobs end at the one that completed it
STOPPED = SamplingParams(temperature=0, max_tokens=24, stop=[" the", "."], logprobs=1)


async def _streamed(llm: sonar.LLM, prompts: list[str], params: SamplingParams) -> list[RequestOutput]:
    """`generate_many`, each prompt streamed: its deltas summed as `generate` sums them."""
    outs: list[RequestOutput] = [RequestOutput(str(i), p, [], [CompletionOutput(0)]) for i, p in enumerate(prompts)]

    async def one(out: RequestOutput) -> None:
        completion = out.outputs[0]
        async for d in llm.stream(out.prompt, params):
            completion.token_ids += d.token_ids
            completion.logprobs = (completion.logprobs or []) + (d.logprobs or [])
            if d.finish_reason is not None:
                completion.finish_reason, completion.stop_reason = d.finish_reason, d.stop_reason

    async with anyio.create_task_group() as tg:
        for out in outs:
            tg.start_soon(one, out)
    return outs


async def _run(
    stream: bool = False, **engine
) -> list[tuple[list[int], tuple[str | None, int | str | None], list[list[tuple[int, float]]]]]:
    async with sonar.open(**ENGINE, **engine) as llm:
        assert llm.info.device == "cpu"
        many = partial(_streamed, llm) if stream else llm.generate_many
        outs = await many(PROMPTS, GREEDY)
        outs += await many(PROMPTS[:2], SEEDED)
        outs += await many(PROMPTS[2:4], PENALIZED)
        outs += await many(PROMPTS, STOPPED)
        assert await llm.tracked_requests() == {"frontend": 0, "scheduler": 0, "detokenizer": 0}
        assert (await llm.stats()).kv_usage == 0.0
    return [
        (
            o.outputs[0].token_ids,
            (o.outputs[0].finish_reason, o.outputs[0].stop_reason),
            [[(lp.token_id, lp.logprob) for lp in p.top] for p in o.outputs[0].logprobs or []],
        )
        for o in outs
    ]


def _same(got, want) -> None:
    assert [(t, r) for t, r, _ in got] == [(t, r) for t, r, _ in want]
    for (_, _, got_lp), (_, _, want_lp) in zip(got, want):
        assert [[t for t, _ in p] for p in got_lp] == [[t for t, _ in p] for p in want_lp]
        for g, w in zip(got_lp, want_lp):
            assert [lp for _, lp in g] == pytest.approx([lp for _, lp in w], abs=1e-4)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def reference():
    return await _run(decode_steps=1)


@pytest.mark.parametrize(
    "engine",
    [dict(decode_steps=4), dict(), dict(stream=True), dict(stream=True, decode_steps=4, stream_steps=False)],
    ids=["answered-whole", "defaults", "streamed", "streamed-held-back"],
)
async def test_same_outputs_as_one_decode_step_per_trip(reference, one_thread, engine) -> None:
    _same(await _run(**engine), reference)
    reasons = [reason for _, (reason, _), _ in reference]
    assert "stop" in reasons and "length" in reasons  # both ways of ending are covered
    assert any(isinstance(stop, str) for _, (_, stop), _ in reference)  # a stop string too
    assert all(lps for _, _, lps in reference[-7:])  # and logprobs, under penalties and stop strings


async def test_a_stream_sees_each_token_as_it_is_sampled_unless_it_holds_them_back(one_thread) -> None:
    ten = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    async with sonar.open(**ENGINE, decode_steps=100) as llm:
        sizes, steps = [], []
        async for d in llm.stream(PROMPTS[0], LONG):
            sizes.append(len(d.token_ids))
            if len(sizes) == 10:
                steps.append((await llm.stats()).num_steps)
    # one token at a time, the tenth while the 100 decode steps after the first were still out
    assert sizes == [1] * 120 and steps == [1]
    async with sonar.open(**ENGINE, decode_steps=4, stream_steps=False) as llm:
        sizes = [len(d.token_ids) async for d in llm.stream(PROMPTS[0], ten)]
    assert sizes == [1, 4, 4, 1]  # the prefill's token, then as many as max_tokens leaves room for
    async with sonar.open(**ENGINE, decode_steps=4, async_scheduling=True) as llm:  # one step per trip there
        sizes = [len(d.token_ids) async for d in llm.stream(PROMPTS[0], ten)]
        assert (await llm.stats()).num_steps == 10
    assert sizes == [1] * 10


async def test_worker_in_its_own_process_and_a_fault(reference, one_thread) -> None:
    _same(await _run(decode_steps=4, placement="worker=process"), reference)
    async with sonar.open(**ENGINE, decode_steps=4, fault_injection="raise@step=6") as llm:
        outs = await llm.generate_many(PROMPTS, GREEDY)
        worker = next(c for c in llm.tree().children if c.name == "worker")
        assert worker.restarts == 1
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs] == [
        (t, r) for t, (r, _), _ in reference[:5]
    ]


@pytest.mark.parametrize("stream_steps", [True, False], ids=["streamed", "held-back"])
async def test_an_arrival_cuts_a_long_multi_step_decode_short(one_thread, stream_steps) -> None:
    async with sonar.open(**ENGINE, decode_steps=1) as llm:
        want_long = (await llm.generate(PROMPTS[0], LONG)).outputs[0].token_ids
        want_short = (await llm.generate(PROMPTS[1], GREEDY)).outputs[0].token_ids
    async with sonar.open(**ENGINE, decode_steps=100, stream_steps=stream_steps, placement="worker=process") as llm:
        sizes: list[int] = []
        tokens: list[int] = []
        short = None
        seen = 0  # the long stream's tokens when the newcomer was done

        async def arrive() -> None:
            nonlocal short, seen
            await anyio.sleep(0.2)  # inside the 100 decode steps that follow the first token
            short = await llm.generate(PROMPTS[1], GREEDY)
            seen = len(tokens)

        async with anyio.create_task_group() as tg:
            async for d in llm.stream(PROMPTS[0], LONG):
                sizes.append(len(d.token_ids))
                tokens += d.token_ids
                if len(sizes) == 1:
                    tg.start_soon(arrive)
        assert short is not None
    assert tokens == want_long and short.outputs[0].token_ids == want_short
    # cut after a few of its 100 decode steps: the newcomer's prefill came next, then its 24
    # decode steps beside the long one's (waiting the 100 out, it would be done past 124)
    assert seen < 90, seen
    if not stream_steps:
        assert sizes[0] == 1 and sizes[1] < 50, sizes


async def test_a_stream_left_early_cuts_its_steps_short_and_frees_everything(one_thread) -> None:
    async with sonar.open(**ENGINE, decode_steps=100) as llm:
        async for _ in llm.stream(PROMPTS[0], LONG):
            break  # after the prefill's token: the abort reaches the scheduler during the decode steps
        with anyio.fail_after(20):
            while (stats := await llm.stats()).num_steps < 2:  # the multi-step decode came back
                await anyio.sleep(0.02)
        assert stats.num_steps < 50  # the prefill, then the decode steps run before the cut
        assert stats.num_running == 0 and stats.kv_usage == 0.0
        assert await llm.tracked_requests() == {"frontend": 0, "scheduler": 0, "detokenizer": 0}


async def test_the_liveness_deadline_counts_each_decode_step(one_thread) -> None:
    """A multi-step decode runs far longer than one step; the worker's watchdog times each of its
    decode steps, so a tight deadline (4x the slowest step so far + 1 s) does not take it for a hang."""
    longer = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)
    async with sonar.open(**ENGINE, decode_steps=240, hang_margin=1.0) as llm:
        out = await llm.generate(PROMPTS[0], longer)
        worker = next(c for c in llm.tree().children if c.name == "worker")
        assert worker.restarts == 0
    assert len(out.outputs[0].token_ids) == 240


async def test_a_grammar_request_beside_plain_ones_decodes_one_step_per_trip(one_thread) -> None:
    """A request under a grammar needs its bitmask every decode step: while it runs, no step is
    multi-step, and both it and the plain request get what one step per trip gives them."""
    import re

    from sonar.sampling_params import StructuredOutputsParams

    regex = SamplingParams(
        temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex="[a-z]{3,8}( [a-z]{3,8}){2}")
    )
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    async def run(**engine) -> list[list[int]]:
        outs: list = [None, None]
        async with sonar.open(**ENGINE, **engine) as llm:

            async def one(i: int, prompt: str, params: SamplingParams) -> None:
                outs[i] = await llm.generate(prompt, params)

            async with anyio.create_task_group() as tg:
                tg.start_soon(one, 0, PROMPTS[3], regex)
                tg.start_soon(one, 1, PROMPTS[0], plain)
        assert re.fullmatch("[a-z]{3,8}( [a-z]{3,8}){2}", outs[0].text), outs[0].text
        return [o.outputs[0].token_ids for o in outs]

    assert await run(decode_steps=4) == await run()


async def test_a_stop_inside_a_run_ends_its_tokens_and_logprobs_there(one_thread) -> None:
    """Answered whole, a run's tokens come back together: those after a stop token or the token
    that completed a stop string are dropped, their logprobs with them."""
    ended = SamplingParams(temperature=0, max_tokens=60, logprobs=1)  # EOS ends some of them

    async def run(**engine) -> list[tuple[list[int], str | None, int | str | None, int]]:
        async with sonar.open(**ENGINE, **engine) as llm:
            text = (await llm.generate(PROMPTS[0], LONG)).text
            start = next(i for i in range(40, len(text) - 3) if text.find(text[i : i + 3]) == i)
            stopped = SamplingParams(temperature=0, max_tokens=120, stop=[text[start : start + 3]], logprobs=1)
            outs = [await llm.generate(p, ended) for p in PROMPTS] + [await llm.generate(PROMPTS[0], stopped)]
        return [
            (o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason, len(o.outputs[0].logprobs))
            for o in outs
        ]

    want = await run(decode_steps=1)
    assert any(reason == "stop" and len(tokens) < 60 for tokens, reason, _, _ in want[:-1])  # EOS
    assert isinstance(want[-1][2], str)  # the stop string
    assert all(len(tokens) == lps for tokens, _, _, lps in want)
    assert await run(decode_steps=8) == want
