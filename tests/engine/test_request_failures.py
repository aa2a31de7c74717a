"""One request cannot take the engine down, through the library on the embedded model:

* a request whose constraints leave no token is refused before it is queued (`InvalidRequestError`
  naming the parameter); if such a row reaches the sampler anyway, that request alone fails;
* a poison request (`--fault-injection raise@token=ID` crashes every step that computes its prompt)
  is quarantined after two crashes (`RequestQuarantinedError`) while the requests beside it finish
  with the text they have alone, and the engine does not give up;
* beyond `max_waiting_seqs` waiting sequences new requests are refused (`ServerOverloadedError`
  with a `retry_after`), the accepted ones complete and the engine serves again afterwards; so is
  a request the scheduler does not take in time.
"""

from __future__ import annotations

import os
import signal

import anyio
import pytest

import sonar
from sonar import SamplingParams
from sonar.engine import llm as llm_module
from sonar.errors import (
    InvalidRequestError,
    RequestQuarantinedError,
    SamplingFailedError,
    ServerOverloadedError,
    SonarError,
)
from sonar.sampling_params import SamplingParamsError

pytestmark = pytest.mark.anyio

ENGINE = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=64, seed=0)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["The capital of France is", "Two plus two equals", "My favourite animal is the"]
#: A special token of SmolLM2 that neither the prompts nor their greedy continuations hold.
POISON = 13


def everything(llm: sonar.LLM) -> list[int]:
    return list(range(llm.info.vocab_size))


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def llm(one_thread):
    """The engine of the tests that crash nothing, its stop-id cap (--max-stop-token-ids) raised
    past the vocabulary so that the no-token check, not the cap, refuses."""
    async with sonar.open(**ENGINE, max_stop_token_ids=1 << 16) as engine:
        yield engine


async def test_a_request_that_leaves_no_token_is_refused_naming_the_parameter(llm) -> None:
    for params in (
        SamplingParams(temperature=1.0, min_tokens=1, stop_token_ids=everything(llm)),
        SamplingParams(temperature=0, min_tokens=3, max_tokens=4, stop_token_ids=everything(llm), ignore_eos=True),
        # every id but the EOS ones: EOS is blocked too while min_tokens are not out
        SamplingParams(
            temperature=1.0,
            min_tokens=1,
            stop_token_ids=[t for t in everything(llm) if t not in llm.info.eos_token_ids],
        ),
    ):
        with pytest.raises(InvalidRequestError, match="no token is left") as caught:
            await llm.generate(PROMPTS[0], params)
        assert caught.value.param == "stop_token_ids"
    # the same ids without min_tokens, or with ignore_eos leaving an EOS id free, are fine
    ok = await llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=2, stop_token_ids=everything(llm)))
    assert ok.finish_reason == "stop" and len(ok.token_ids) == 1
    free_eos = [t for t in everything(llm) if t not in llm.info.eos_token_ids]
    ok = await llm.generate(
        PROMPTS[0],
        SamplingParams(temperature=0, max_tokens=2, min_tokens=1, stop_token_ids=free_eos, ignore_eos=True),
    )
    assert len(ok.token_ids) >= 1
    assert await llm.tracked_requests() == {"frontend": 0, "scheduler": 0, "detokenizer": 0}


def test_the_no_token_left_check_is_its_own_function() -> None:
    params = SamplingParams(min_tokens=1, stop_token_ids=[0, 1, 2])
    params.check_token_left(vocab_size=4, eos_token_ids=[])  # id 3 is left
    with pytest.raises(SamplingParamsError) as caught:
        params.check_token_left(vocab_size=4, eos_token_ids=[3])
    assert caught.value.param == "stop_token_ids"
    SamplingParams(min_tokens=1, stop_token_ids=[0, 1, 2], ignore_eos=True).check_token_left(
        vocab_size=4, eos_token_ids=[3]
    )
    SamplingParams(min_tokens=0, stop_token_ids=[0, 1, 2, 3]).check_token_left(vocab_size=4)


async def test_a_row_with_no_token_fails_its_request_alone(llm) -> None:
    """Past admission (its check bypassed here), a fully masked row ends its own request with an
    error; the greedy request beside it gets the text it gets alone, and the engine goes on."""
    alone = (await llm.generate(PROMPTS[1], GREEDY)).text
    masked = SamplingParams(temperature=1.0, min_tokens=1, max_tokens=4, stop_token_ids=everything(llm))
    failures: list[BaseException] = []
    texts: list[str] = []

    async def doomed() -> None:
        ids, _, _ = await llm._prepare(PROMPTS[0], SamplingParams())  # tokenized, not checked with `masked`
        try:
            async for _ in llm._run("masked-row", ids, masked, 0, None):
                pass
        except SonarError as exc:
            failures.append(exc)

    async def greedy() -> None:
        texts.append((await llm.generate(PROMPTS[1], GREEDY)).text)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(doomed)
            tg.start_soon(greedy)
    assert len(failures) == 1 and isinstance(failures[0], SamplingFailedError)
    assert "no token could be sampled" in str(failures[0])
    assert "masked-row" in str(failures[0])
    assert texts == [alone]
    assert llm.dead is None
    worker = next(c for c in llm.tree().children if c.name == "worker")
    assert worker.restarts == 0
    assert await llm.tracked_requests() == {"frontend": 0, "scheduler": 0, "detokenizer": 0}


@pytest.mark.parametrize("async_scheduling", [False, True])
async def test_a_poison_request_is_quarantined_and_the_others_finish_unchanged(llm, async_scheduling) -> None:
    """The reference texts come from the module's synchronous engine (async scheduling gives the
    same tokens: tests/engine/test_async_scheduling.py)."""
    outs = await llm.generate_many(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outs):
        assert POISON not in llm.tokenizer(prompt).input_ids + out.token_ids
    reference = [o.text for o in outs]
    engine = dict(ENGINE, async_scheduling=async_scheduling, fault_injection=f"raise@token={POISON}")
    async with sonar.open(**engine) as crashing:
        poisoned = crashing.tokenizer("A poisoned prompt").input_ids + [POISON] + crashing.tokenizer(" it is").input_ids
        quarantined: list[BaseException] = []
        texts: dict[int, str] = {}

        async def poison() -> None:
            try:
                await crashing.generate(poisoned, GREEDY, request_id="poison-1")
            except RequestQuarantinedError as exc:
                quarantined.append(exc)

        async def normal(i: int) -> None:
            texts[i] = (await crashing.generate(PROMPTS[i], GREEDY)).text

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                tg.start_soon(poison)
                for i in range(len(PROMPTS)):
                    tg.start_soon(normal, i)
        assert len(quarantined) == 1 and "poison-1" in str(quarantined[0])
        assert [texts[i] for i in range(len(PROMPTS))] == reference
        assert crashing.dead is None
        worker = next(c for c in crashing.tree().children if c.name == "worker")
        assert 2 <= worker.restarts <= 3 and worker.state == "running"
        assert (await crashing.generate(PROMPTS[0], GREEDY)).text == reference[0]  # and it serves on
        assert await crashing.tracked_requests() == {"frontend": 0, "scheduler": 0, "detokenizer": 0}


async def test_requests_beyond_max_waiting_seqs_are_refused_as_overloaded(one_thread) -> None:
    long = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    async with sonar.open(**ENGINE, max_num_seqs=1, max_waiting_seqs=2) as llm:
        done: list[int] = []
        refused: list[ServerOverloadedError] = []

        async def one(i: int) -> None:
            try:
                out = await llm.generate(f"{PROMPTS[i % 3]} {i}", long)
            except ServerOverloadedError as exc:
                refused.append(exc)
            else:
                done.append(len(out.token_ids))

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for i in range(8):
                    tg.start_soon(one, i)
        # one runs and two wait at most while the burst arrives: at least five are refused
        assert len(refused) >= 5 and all(n == 24 for n in done) and len(done) + len(refused) == 8
        assert all("--max-waiting-seqs 2" in str(e) and e.retry_after > 0 for e in refused)
        # n counts n: four completions never fit one running and two waiting
        with pytest.raises(ServerOverloadedError):
            await llm.generate(PROMPTS[0], SamplingParams(n=4, temperature=0.5, max_tokens=24, ignore_eos=True))
        assert (await llm.generate(PROMPTS[0], GREEDY)).token_ids  # served again once the queue drained
        with anyio.fail_after(10):
            while (tracked := await llm.tracked_requests()) != {"frontend": 0, "scheduler": 0, "detokenizer": 0}:
                await anyio.sleep(0.05)
        assert tracked["scheduler"] == 0


async def test_a_scheduler_that_does_not_answer_in_time_is_overloaded_not_an_error(one_thread, monkeypatch) -> None:
    """The scheduler (in its own process, stopped with SIGSTOP) takes no request within the add
    timeout: `ServerOverloadedError`, not a bare timeout; once it runs again it serves."""
    monkeypatch.setattr(llm_module, "ADD_TIMEOUT", 1.0)
    async with sonar.open(**ENGINE, placement="scheduler=process") as llm:
        pid = next(c for c in llm.tree().children if c.name == "scheduler").pid
        assert pid is not None and pid != os.getpid()
        os.kill(pid, signal.SIGSTOP)
        try:
            with anyio.fail_after(20), pytest.raises(ServerOverloadedError, match="did not take the request") as caught:
                await llm.generate(PROMPTS[0], GREEDY)
            assert caught.value.retry_after > 0
        finally:
            os.kill(pid, signal.SIGCONT)
        with anyio.fail_after(60):
            assert len((await llm.generate(PROMPTS[0], GREEDY)).token_ids) == GREEDY.max_tokens
            # the refused request, taken late, was aborted by the frontend that gave up on it
            while await llm.tracked_requests() != {"frontend": 0, "scheduler": 0, "detokenizer": 0}:
                await anyio.sleep(0.05)
