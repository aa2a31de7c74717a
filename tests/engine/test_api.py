"""Behaviour of the library API (`sonar.open`) on the real embedded model (SmolLM2-135M-Instruct).

One float32 engine serves the whole module (opening one costs seconds); every test leaves it
idle, which the autouse `engine_idle_after` fixture checks: no request running or waiting and
every KV block free.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

import sonar
from sonar import InvalidRequestError, SamplingParams, SamplingParamsError

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 256
NUM_BLOCKS = 96
#: Long enough (> one 16-token block) that a repeat of it hits the prefix cache.
LONG_PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type with an oil-based ink and a screw press. Within fifty years"
)
STORY = "Once upon a time, in a small village by the sea,"


@pytest.fixture(scope="module")
def anyio_backend():
    # Module scope (conftest's is per test) so that one engine can serve the whole module.
    return "asyncio"


@pytest.fixture(scope="module")
async def llm(one_thread):
    async with sonar.open(
        dtype="float32", max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=NUM_BLOCKS, seed=0
    ) as engine:
        yield engine


@pytest.fixture(autouse=True)
async def engine_idle_after(llm):
    yield
    await wait_idle(llm)


async def wait_idle(llm: sonar.LLM, timeout: float = 3.0) -> Any:
    """Wait until the engine has no request left and all its KV blocks are free; fail otherwise."""
    stats = None
    with anyio.move_on_after(timeout):
        while True:
            stats = await llm.stats()
            if (stats.num_running, stats.num_waiting, stats.num_free_blocks) == (0, 0, llm.info.num_blocks):
                assert stats.kv_usage == 0
                return stats
            await anyio.sleep(0.02)
    pytest.fail(f"the engine is not idle {timeout} s later: {stats}")


async def run_all(calls: list[Any]) -> list[Any]:
    """Await the coroutine functions together (so the engine batches them); results in order."""
    results: list[Any] = [None] * len(calls)

    async def one(i: int) -> None:
        results[i] = await calls[i]()

    async with anyio.create_task_group() as tg:
        for i in range(len(calls)):
            tg.start_soon(one, i)
    return results


async def expect_invalid(call: Any) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        await call
    return info.value


def greedy(max_tokens: int = 16, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def text_offsets(tokenizer: Any, prompt_ids: list[int], out_ids: list[int]) -> list[int]:
    """offsets[k]: length of the output text made by the first k output tokens (in context)."""
    base = len(tokenizer.decode(prompt_ids))
    return [len(tokenizer.decode(prompt_ids + out_ids[:k])) - base for k in range(len(out_ids) + 1)]


# 1 ---------------------------------------------------------------------------------------------
async def test_seeded_sampling_is_reproducible_alone_and_in_any_batch(llm):
    seeded = SamplingParams(temperature=0.8, seed=1234, max_tokens=12, ignore_eos=True)
    alone = await llm.generate(STORY, seeded)
    assert len(alone.token_ids) == 12

    # The same request among others: seeded and unseeded, sampled and greedy, other prompts.
    batch = await run_all(
        [
            lambda: llm.generate(STORY, seeded),
            lambda: llm.generate(LONG_PROMPT, SamplingParams(temperature=0.8, seed=7, max_tokens=12)),
            lambda: llm.generate(STORY, SamplingParams(temperature=0.8, max_tokens=12)),
            lambda: llm.generate("def fibonacci(n):", SamplingParams(temperature=1.0, max_tokens=9)),
            lambda: llm.generate("List three colors:", greedy(12)),
            lambda: llm.generate(STORY, seeded),
        ]
    )
    assert batch[0].token_ids == alone.token_ids
    assert batch[5].token_ids == alone.token_ids
    assert batch[0].text == alone.text
    many = await llm.generate_many([STORY, "Water boils at", STORY], seeded)
    assert many[0].token_ids == many[2].token_ids == alone.token_ids
    assert many[1].prompt_token_ids != many[0].prompt_token_ids  # order kept

    # Other seeds give other samples.
    others = await run_all(
        [
            (lambda s=s: llm.generate(STORY, SamplingParams(temperature=0.8, seed=s, max_tokens=12, ignore_eos=True)))
            for s in (1235, 1236, 1237)
        ]
    )
    samples = {tuple(alone.token_ids)} | {tuple(o.token_ids) for o in others}
    assert len(samples) == 4, "four seeds should give four different samples"


# 2 ---------------------------------------------------------------------------------------------
async def test_stop_strings_stop_token_ids_and_ignore_eos(llm):
    tok = llm.tokenizer
    base = await llm.generate(LONG_PROMPT, greedy(24, ignore_eos=True))
    full, out_ids = base.text, base.token_ids
    offsets = text_offsets(tok, base.prompt_token_ids, out_ids)
    assert offsets[-1] == len(full)

    # A 4-character stop string, two characters on each side of the boundary before token k.
    k = next(
        (
            k
            for k in range(1, len(out_ids) - 1)
            if offsets[k] - offsets[k - 1] >= 2
            and offsets[k + 1] - offsets[k] >= 2
            and full.find(full[offsets[k] - 2 : offsets[k] + 2]) == offsets[k] - 2
        ),
        None,
    )
    assert k is not None, f"no token boundary to put a stop string on in {full!r}"
    cut = offsets[k] - 2
    stop = full[cut : cut + 4]
    assert tok.decode(out_ids[k - 1 : k]).endswith(stop[:2]) and tok.decode(out_ids[k : k + 1]).startswith(stop[2:])

    hit = await llm.generate(LONG_PROMPT, greedy(24, stop=[stop, "never appears \x01"]))
    assert hit.text == full[:cut]
    assert (hit.finish_reason, hit.stop_reason) == ("stop", stop)
    assert hit.token_ids == out_ids[: k + 1]  # up to the token that completed the stop string
    kept = await llm.generate(LONG_PROMPT, greedy(24, stop=stop, include_stop_str_in_output=True))
    assert kept.text == full[: cut + 4]
    assert (kept.finish_reason, kept.stop_reason) == ("stop", stop)
    # Streamed, the stop string never leaks out (not even half of it).
    deltas = [d async for d in llm.stream(LONG_PROMPT, greedy(24, stop=[stop]))]
    assert "".join(d.text for d in deltas) == full[:cut]
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == stop

    # A stop token id: the request ends on its first occurrence, its text left out.
    stop_id = out_ids[3]
    j = out_ids.index(stop_id)
    by_id = await llm.generate(LONG_PROMPT, greedy(24, stop_token_ids=[stop_id]))
    assert (by_id.finish_reason, by_id.stop_reason) == ("stop", stop_id)
    assert by_id.token_ids == out_ids[: j + 1]
    assert by_id.text == full[: offsets[j]]

    # EOS ends a chat answer; with ignore_eos the same request runs on to max_tokens.
    chat_ids = await llm.apply_chat_template([{"role": "user", "content": "Say hi."}])
    eos = await llm.generate(chat_ids, greedy(64))
    assert eos.finish_reason == "stop" and eos.stop_reason in llm.info.eos_token_ids
    assert eos.token_ids[-1] == eos.stop_reason and len(eos.token_ids) < 64
    n = len(eos.token_ids) + 5
    on = await llm.generate(chat_ids, greedy(n, ignore_eos=True))
    assert (on.finish_reason, on.stop_reason) == ("length", None)
    assert len(on.token_ids) == n and on.token_ids[: len(eos.token_ids)] == eos.token_ids
    assert on.text.startswith(eos.text)
    short = await llm.generate(LONG_PROMPT, greedy(5))
    assert (short.finish_reason, len(short.token_ids)) == ("length", 5)


# 3 ---------------------------------------------------------------------------------------------
async def test_emoji_and_cjk_round_trip(llm):
    prompt = "中文：你好世界 🌍🚀。English:"
    params = greedy(24)
    out = await llm.generate(prompt, params)
    assert llm.tokenizer.decode(out.prompt_token_ids) == prompt
    assert out.prompt == prompt
    assert any(ord(c) > 0xFFFF for c in out.text), f"expected emoji in the output, got {out.text!r}"
    assert "\ufffd" not in out.text
    deltas = [d async for d in llm.stream(prompt, params)]
    assert all("\ufffd" not in d.text for d in deltas)
    assert "".join(d.text for d in deltas) == out.text
    assert [t for d in deltas for t in d.token_ids] == out.token_ids
    assert [d.finish_reason for d in deltas][-1] == out.finish_reason
    assert all(d.finish_reason is None for d in deltas[:-1])
    # Piece by piece, the text is what decoding prompt and output at once gives.
    assert llm.tokenizer.decode(out.prompt_token_ids + out.token_ids) == prompt + out.text
    # Token ids as the prompt give the same result as the text.
    by_ids = await llm.generate(out.prompt_token_ids, params)
    assert by_ids.token_ids == out.token_ids and by_ids.text == out.text and by_ids.prompt is None


# 4 ---------------------------------------------------------------------------------------------
async def test_cancelled_generate_and_abandoned_stream_free_everything(llm):
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def running(count: int) -> bool:
        stats = await llm.stats()
        return stats.num_running == count and stats.num_free_blocks < llm.info.num_blocks

    finished = []

    async def victim() -> None:
        finished.append(await llm.generate(LONG_PROMPT, long))

    async with anyio.create_task_group() as tg:
        tg.start_soon(victim)
        tg.start_soon(victim)
        with anyio.fail_after(20):
            while not await running(2):
                await anyio.sleep(0.02)
        tg.cancel_scope.cancel()
    assert not finished
    await wait_idle(llm, timeout=2)

    seen = 0
    async for delta in llm.stream(STORY, long):
        seen += len(delta.token_ids)
        if seen >= 3:
            break
    assert seen >= 3
    await wait_idle(llm, timeout=2)

    # Cancelled at any early moment (tokenizing, being added, waiting, prefilling): same.
    for delay in (0, 0.002, 0.01, 0.05):
        with anyio.move_on_after(delay) as scope:
            await llm.generate(STORY, long)
        assert scope.cancelled_caught
        await wait_idle(llm, timeout=2)

    # The engine still serves.
    out = await llm.generate("The capital of France is", greedy(4))
    assert len(out.token_ids) == 4


# 5 ---------------------------------------------------------------------------------------------
def check_positions(positions: list[Any], token_ids: list[int], n: int) -> None:
    assert len(positions) == len(token_ids)
    for pos, token in zip(positions, token_ids):
        assert pos.token_id == token
        top = [lp.logprob for lp in pos.top]
        assert len(top) == n and top == sorted(top, reverse=True)
        assert all(lp <= 0 and math.isfinite(lp) for lp in top + [pos.logprob])
        assert sum(math.exp(lp) for lp in top) <= 1 + 1e-4
        assert pos.rank >= 1
        if pos.rank <= n:  # the chosen token is among the top ones, at its rank
            assert pos.top[pos.rank - 1].token_id == token
            assert pos.top[pos.rank - 1].logprob == pytest.approx(pos.logprob, abs=1e-5)
        else:
            assert token not in [lp.token_id for lp in pos.top] and pos.logprob <= top[-1] + 1e-6


async def test_n_logprobs_and_prompt_logprobs(llm):
    tok = llm.tokenizer
    params = SamplingParams(n=2, temperature=0.8, seed=42, max_tokens=10, logprobs=3, ignore_eos=True)
    out = await llm.generate(STORY, params)
    assert [o.index for o in out.outputs] == [0, 1]
    for o in out.outputs:
        assert len(o.token_ids) == 10 and o.finish_reason == "length"
        assert o.text and o.text == tok.decode(out.prompt_token_ids + o.token_ids)[len(STORY) :]
        check_positions(o.logprobs, o.token_ids, 3)
    assert out.outputs[0].token_ids != out.outputs[1].token_ids
    # Completion i of a seeded request is the single request with seed + i.
    singles = await run_all(
        [
            (
                lambda i=i: llm.generate(
                    STORY, SamplingParams(temperature=0.8, seed=42 + i, max_tokens=10, ignore_eos=True)
                )
            )
            for i in range(2)
        ]
    )
    assert [s.token_ids for s in singles] == [o.token_ids for o in out.outputs]
    streamed = [d async for d in llm.stream(STORY, params)]
    assert sorted({d.index for d in streamed}) == [0, 1]
    for i in range(2):
        assert [t for d in streamed if d.index == i for t in d.token_ids] == out.outputs[i].token_ids
        assert [d.finish_reason for d in streamed if d.index == i][-1] == "length"

    # Greedy: the chosen token is the top one.
    g = await llm.generate(LONG_PROMPT, greedy(8, logprobs=3))
    check_positions(g.logprobs, g.token_ids, 3)
    assert all(p.rank == 1 for p in g.logprobs)
    zero = await llm.generate(LONG_PROMPT, greedy(3, logprobs=0))
    assert [p.top for p in zero.logprobs] == [[]] * 3
    assert [p.logprob for p in zero.logprobs] == pytest.approx([p.logprob for p in g.logprobs[:3]], abs=1e-4)
    assert (await llm.generate(LONG_PROMPT, greedy(3))).logprobs is None

    # Echo scoring: the prompt's own logprobs, one per prompt token, the first None. Scoring
    # prompt + greedy output must give the output tokens the logprobs they were sampled with,
    # even though the prompt's first blocks are in the prefix cache by now.
    echo_ids = g.prompt_token_ids + g.token_ids
    scored = await llm.generate(echo_ids, greedy(1, prompt_logprobs=2))
    plp = scored.prompt_logprobs
    assert len(plp) == len(echo_ids) and plp[0] is None
    check_positions(plp[1:], echo_ids[1:], 2)
    tail = [p.logprob for p in plp[len(g.prompt_token_ids) :]]
    assert tail == pytest.approx([p.logprob for p in g.logprobs], abs=2e-3)
    assert scored.num_cached_tokens == 0  # prompt logprobs need every position computed
    # With n=2 there is still one list of prompt logprobs.
    two = await llm.generate(LONG_PROMPT, SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=2, prompt_logprobs=0))
    assert len(two.prompt_logprobs) == len(two.prompt_token_ids) and two.prompt_logprobs[0] is None
    assert [p.token_id for p in two.prompt_logprobs[1:]] == two.prompt_token_ids[1:]
    # Without prompt logprobs, a repeated prompt is served from the prefix cache.
    again = await llm.generate(LONG_PROMPT, greedy(2))
    assert again.num_cached_tokens >= llm.info.block_size
    assert again.prompt_logprobs is None


# 6 ---------------------------------------------------------------------------------------------
async def test_invalid_requests_are_rejected_and_the_engine_keeps_serving(llm):
    ok = greedy(4)
    ref = await llm.generate("The capital of France is", ok)

    too_long = [504] * (MAX_MODEL_LEN + 1)
    with pytest.raises(InvalidRequestError) as info:
        await llm.generate(too_long, ok)
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"
    with pytest.raises(InvalidRequestError):
        await llm.generate("word " * (MAX_MODEL_LEN + 10), ok)
    with pytest.raises(InvalidRequestError):
        async for _ in llm.stream(too_long, ok):
            pass
    # ... while requests around it are served.
    results = await run_all(
        [
            lambda: llm.generate("The capital of France is", ok),
            lambda: expect_invalid(llm.generate(too_long, ok)),
            lambda: llm.generate("The capital of France is", ok),
        ]
    )
    assert [results[0].token_ids, results[2].token_ids] == [ref.token_ids] * 2
    assert isinstance(results[1], InvalidRequestError)

    vocab = llm.info.vocab_size
    for bad in ([1, 2, vocab], [-1], [vocab + 1000]):
        with pytest.raises(InvalidRequestError) as info:
            await llm.generate(bad, ok)
        assert info.value.param == "prompt"
    await llm.generate([vocab - 1], greedy(1))  # the last id is fine

    for empty in ("", []):
        with pytest.raises(InvalidRequestError):
            await llm.generate(empty, ok)

    with pytest.raises(SamplingParamsError):
        SamplingParams(temperature=-1)
    negative = SamplingParams()
    negative.temperature = -1.0  # bypasses construction's check; the engine checks again
    with pytest.raises(InvalidRequestError) as info:
        await llm.generate("Hello", negative)
    assert info.value.param == "temperature"
    cap = llm.config.max_logprobs
    for params, name in [
        (SamplingParams(logprobs=cap + 1), "logprobs"),
        (SamplingParams(prompt_logprobs=cap + 1), "prompt_logprobs"),
        (SamplingParams(stop_token_ids=[vocab]), "stop_token_ids"),
        (SamplingParams(logit_bias={vocab: 1.0}), "logit_bias"),
    ]:
        with pytest.raises(InvalidRequestError) as info:
            await llm.generate("Hello", params)
        assert info.value.param == name
    await llm.generate("Hello", SamplingParams(logprobs=cap, max_tokens=1))  # the cap itself is fine

    # Nothing was left behind by the rejections.
    await wait_idle(llm)
    assert (await llm.generate("The capital of France is", ok)).token_ids == ref.token_ids


# 7 ---------------------------------------------------------------------------------------------
async def test_chat_applies_the_template(llm):
    tok = llm.tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = await llm.chat(messages, greedy(32))
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert out.prompt_token_ids[0] == im_start
    expected = tok(
        tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    ).input_ids
    assert out.prompt_token_ids == expected
    assert out.prompt_token_ids[-4:] == tok("<|im_start|>assistant\n", add_special_tokens=False).input_ids
    assert "Paris" in out.text and "<|im" not in out.text
    assert out.finish_reason in ("stop", "length")
    same = await llm.generate(expected, greedy(32))
    assert same.text == out.text
    with pytest.raises(InvalidRequestError):
        await llm.chat(messages, greedy(4), add_generation_prompt=True, continue_final_message=True)


# 9 ---------------------------------------------------------------------------------------------
#: The README's example of the library API (between <!-- example:start --> and <!-- example:end -->).
def readme_example() -> str:
    """The library example of README.md (between its example markers), as written there."""
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- example:start -->", 1)[1].split("<!-- example:end -->", 1)[0]
    return block.strip().removeprefix("```bash").removesuffix("```").strip()


async def test_readme_example_runs():
    # `python` of the README is this interpreter (the project's .venv).
    env = dict(
        os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", HF_HUB_OFFLINE="1"
    )
    with anyio.fail_after(180):
        proc = await anyio.run_process(["bash", "-c", readme_example()], cwd=ROOT, env=env, check=False)
    stdout, stderr = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0, stderr[-3000:]
    assert "Paris" in stdout, (stdout, stderr[-3000:])
