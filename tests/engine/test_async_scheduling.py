"""Async scheduling through the whole engine (SmolLM2, real worker): step N+1 is scheduled and
sent before step N's tokens are back, and the tokens, finish reasons and counts are those of the
synchronous loop — with stop tokens, `max_tokens`, seeded sampling, a worker in its own process
(ordered asks over ZMQ), an injected worker fault, and a request abandoned mid-stream."""

from __future__ import annotations

import anyio
import pytest

import sonar
from sonar import SamplingParams
from tests.engine.step_loops import ENGINE, GREEDY, PROMPTS, SEEDED

pytestmark = pytest.mark.anyio


async def _run(**engine) -> list[tuple[list[int], str | None]]:
    async with sonar.open(**ENGINE, **engine) as llm:
        assert llm.info.device == "cpu"
        greedy = await llm.generate_many(PROMPTS, GREEDY)
        seeded = await llm.generate_many(PROMPTS[:2], SEEDED)
        assert await llm.tracked_requests() == {"frontend": 0, "scheduler": 0, "detokenizer": 0}
    return [(o.token_ids, o.finish_reason) for o in greedy + seeded]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def reference() -> list[tuple[list[int], str | None]]:
    return await _run(async_scheduling=False)


async def test_same_tokens_as_the_synchronous_loop(reference, one_thread) -> None:
    assert await _run(async_scheduling=True) == reference
    reasons = [reason for _, reason in reference]
    assert "stop" in reasons and "length" in reasons  # both ways of ending are covered
    assert all(len(tokens) == GREEDY.max_tokens for tokens, reason in reference[:5] if reason == "length")


async def test_worker_in_its_own_process(reference, one_thread) -> None:
    assert await _run(async_scheduling=True, placement="worker=process") == reference


async def test_a_worker_fault_is_recovered_with_the_same_tokens(reference, one_thread) -> None:
    async with sonar.open(**ENGINE, async_scheduling=True, fault_injection="raise@step=6") as llm:
        outs = await llm.generate_many(PROMPTS, GREEDY)
        worker = next(c for c in llm.tree().children if c.name == "worker")
        assert worker.restarts == 1
    assert [(o.token_ids, o.finish_reason) for o in outs] == reference[:5]


async def test_a_stream_left_early_frees_everything(reference, one_thread) -> None:
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    async with sonar.open(**ENGINE, async_scheduling=True) as llm:
        seen = 0
        async for _ in llm.stream(PROMPTS[0], long):
            seen += 1
            if seen == 5:
                break
        outs = await llm.generate_many(PROMPTS, GREEDY)
        with anyio.fail_after(10):
            while (await llm.stats()).num_running:
                await anyio.sleep(0.05)
        stats = await llm.stats()
        assert await llm.tracked_requests() == {"frontend": 0, "scheduler": 0, "detokenizer": 0}
    assert [(o.token_ids, o.finish_reason) for o in outs] == reference[:5]
    assert stats.kv_usage == 0.0
