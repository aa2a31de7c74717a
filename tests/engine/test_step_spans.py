"""--collect-detailed-traces with an OTLP endpoint: the scheduler's per-step spans
(`sonar.engine.step_spans`) and the worker's parts of each step, exported to a real OTLP/HTTP
receiver (`tests.otlp_receiver`) by an engine serving a tiny random-weight Llama through the
library; and the pure parts: a step's attributes, the worker's spans per module, the clocks."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator

import anyio
import pytest
import torch

import sonar
from sonar.core.outputs import ScheduledRequest, SchedulerOutput, StepRef
from sonar.engine.config import EngineConfig
from sonar.engine.otlp import epoch_ns
from sonar.engine.runner import worker_spans
from sonar.engine.step_spans import MAX_PENDING_STEPS, MAX_STEP_LINKS, StepMarks, StepTracer, step_attributes
from sonar.protocol.engine import StepResult
from tests.engine.conftest import save_word_tokenizer, spread_weights
from tests.models.conftest import _tiny_configs
from tests.otlp_receiver import Receiver, attributes, free_port

pytestmark = pytest.mark.anyio

ENGINE = dict(dtype="float32", num_gpu_blocks_override=64, seed=0)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(7)
    hf = AutoModelForCausalLM.from_config(_tiny_configs()["llama3"], dtype=torch.float32)
    spread_weights(hf)
    path = tmp_path_factory.mktemp("step-spans-llama")
    hf.save_pretrained(str(path))
    save_word_tokenizer(Path(path), hf.config.vocab_size)
    return str(path)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.stop()


def scheduled(req_id: str, tokens: int, start: int, prompt: int) -> ScheduledRequest:
    return ScheduledRequest(
        req_id, list(range(tokens)), start, [0], sample=True, is_new=False, num_prompt_tokens=prompt
    )


def test_a_steps_attributes_split_prefill_from_decode() -> None:
    output = SchedulerOutput(
        step_id=3,
        requests=[scheduled("a", 1, 12, 10), scheduled("b", 1, 20, 8), scheduled("c", 9, 0, 9)],
        num_scheduled_tokens=11,
        preempted_req_ids=["d"],
        finished_req_ids=[],
    )
    result = StepResult(step_id=3, sampled={"a": [5], "c": [6]}, failed={"b": "every logit was -inf"}, seconds=0.25)
    assert step_attributes(output, result) == {
        "sonar.step.id": 3,
        "sonar.step.batch_size": 3,
        "sonar.step.tokens": 11,
        "sonar.step.prefill_requests": 1,
        "sonar.step.prefill_tokens": 9,
        "sonar.step.decode_requests": 2,
        "sonar.step.decode_tokens": 2,
        "sonar.step.preemptions": 1,
        "sonar.step.sampled_tokens": 2,
        "sonar.step.failed_requests": 1,
        "sonar.step.worker_seconds": 0.25,
    }


def test_the_worker_times_the_parts_its_modules_name() -> None:
    mono = time.monotonic_ns()
    execute, forward, sample = (mono, mono + 9_000), (mono + 1_000, mono + 5_000), (mono + 6_000, mono + 8_000)
    names = {
        value: [s.name for s in worker_spans(EngineConfig(collect_detailed_traces=value), execute, forward, sample)]
        for value in ("worker", "model", "all")
    }
    assert names == {
        "worker": ["worker.execute", "worker.sample"],
        "model": ["model.forward"],
        "all": ["worker.execute", "worker.sample", "model.forward"],
    }
    (spans,) = [worker_spans(EngineConfig(collect_detailed_traces="all"), execute, forward, (0, 0))]
    assert [s.name for s in spans] == ["worker.execute", "model.forward"]  # a step that sampled nothing
    assert spans[0].end_ns - spans[0].start_ns == 9_000  # the monotonic clock's durations, on the epoch
    assert abs(spans[0].start_ns - time.time_ns()) < 1e9


def test_epoch_ns_moves_a_monotonic_reading_by_the_clocks_offset() -> None:
    assert epoch_ns(1_000, now=(5_000, 1_700_000_000_000_000_000)) == 1_700_000_000_000_000_000 - 4_000
    assert abs(epoch_ns(time.monotonic_ns()) - time.time_ns()) < 50_000_000


def test_an_engine_endpoint_takes_effect_only_with_detailed_traces() -> None:
    with pytest.raises(ValueError, match="otlp_traces_endpoint: .*collect_detailed_traces"):
        EngineConfig.from_args(None, otlp_traces_endpoint="http://127.0.0.1:4318")
    with pytest.raises(ValueError, match="otlp_traces_endpoint: .*OTLP/HTTP"):
        EngineConfig.from_args(None, otlp_traces_endpoint="collector:4317", collect_detailed_traces="all")
    on = EngineConfig.from_args(None, otlp_traces_endpoint="http://127.0.0.1:4318", collect_detailed_traces="model")
    assert on.step_spans and not EngineConfig.from_args(None, collect_detailed_traces="all").step_spans


def span_id(ref: StepRef) -> bytes:
    return ref.span_id.to_bytes(8, "big")


async def stream_all(llm: sonar.LLM, prompts: list[list[int]], max_tokens: list[int]) -> list[dict[str, Any]]:
    """Stream the prompts at once; per request, its tokens and what its updates said of its steps."""
    seen: list[dict[str, Any]] = [{"tokens": 0, "links": [], "model_time": None} for _ in prompts]

    async def one(i: int) -> None:
        params = sonar.SamplingParams(max_tokens=max_tokens[i], ignore_eos=True, temperature=0.0)
        async for delta in llm.stream(prompts[i], params):
            seen[i]["tokens"] += len(delta.token_ids)
            if delta.model_time is not None:
                seen[i]["model_time"] = delta.model_time
                seen[i]["links"] += delta.model_time.links

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return seen


async def test_three_requests_steps_reach_the_collector_with_the_forward_passes(
    tiny_llama: str, receiver: Receiver, one_thread: Any
) -> None:
    prompts = [[11, 12, 13, 14, 15], list(range(40, 61)), [7, 8, 9]]
    max_tokens = [5, 7, 3]
    async with sonar.open(
        tiny_llama, **ENGINE, collect_detailed_traces="model", otlp_traces_endpoint=receiver.endpoint
    ) as llm:
        seen = await stream_all(llm, prompts, max_tokens)
    for request, n in zip(seen, max_tokens):
        assert request["tokens"] == n
        model_time = request["model_time"]
        assert model_time.steps == n == len(request["links"])  # a prefill step, then a step per token but the last
        assert model_time.execute_seconds is None and model_time.forward_seconds > 0  # "model" only
    linked: set[StepRef] = {ref for request in seen for ref in request["links"]}
    steps = receiver.spans_by_id({span_id(ref) for ref in linked})
    assert {(s.trace_id, s.span_id) for s in steps.values()} == {(r.trace_id, span_id(r)) for r in linked}
    a = [attributes(s) for s in steps.values()]
    assert sum(x["sonar.step.batch_size"] for x in a) == sum(max_tokens)
    assert sum(x["sonar.step.sampled_tokens"] for x in a) == sum(max_tokens)
    assert sum(x["sonar.step.tokens"] for x in a) == sum(map(len, prompts)) + sum(max_tokens) - 3
    assert sum(x["sonar.step.prefill_tokens"] for x in a) == sum(map(len, prompts))
    for step in steps.values():
        assert step.name == "scheduler.step" and step.parent_span_id == b""
        children = {c.name: c for c in receiver.wait_for(lambda c: c.parent_span_id == step.span_id, 2)}
        assert set(children) == {"scheduler.schedule", "model.forward"}  # no worker.* spans: not asked for
        forward, schedule = children["model.forward"], children["scheduler.schedule"]
        assert step.start_time_unix_nano <= schedule.start_time_unix_nano <= schedule.end_time_unix_nano
        assert schedule.end_time_unix_nano <= forward.start_time_unix_nano < forward.end_time_unix_nano
        assert forward.end_time_unix_nano <= step.end_time_unix_nano
        took = (forward.end_time_unix_nano - forward.start_time_unix_nano) / 1e9
        assert 0 < took < attributes(step)["sonar.step.worker_seconds"]


async def test_a_long_request_links_only_its_first_steps(tiny_llama: str, receiver: Receiver, one_thread: Any) -> None:
    n = MAX_STEP_LINKS + 8
    async with sonar.open(
        tiny_llama, **ENGINE, collect_detailed_traces="worker", otlp_traces_endpoint=receiver.endpoint
    ) as llm:
        (request,) = await stream_all(llm, [[3, 4, 5]], [n])
    assert request["model_time"].steps == n
    assert len(request["links"]) == MAX_STEP_LINKS
    steps = receiver.spans_by_id({span_id(ref) for ref in request["links"]})
    ids = sorted(attributes(s)["sonar.step.id"] for s in steps.values())
    assert attributes(min(steps.values(), key=lambda s: s.start_time_unix_nano))["sonar.step.prefill_requests"] == 1
    assert ids == list(range(ids[0], ids[0] + MAX_STEP_LINKS))  # the first ones, in a row
    for step in steps.values():
        children = receiver.wait_for(lambda c: c.parent_span_id == step.span_id, 3)
        assert sorted(c.name for c in children) == ["scheduler.schedule", "worker.execute", "worker.sample"]


async def test_a_dead_collector_never_holds_up_serving(tiny_llama: str, one_thread: Any) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    async with sonar.open(tiny_llama, **ENGINE, collect_detailed_traces="all", otlp_traces_endpoint=dead) as llm:
        opened = time.monotonic()
        seen = await stream_all(llm, [[5, 6, 7], [8, 9]], [24, 24])
        served = time.monotonic()
    assert [r["tokens"] for r in seen] == [24, 24]
    assert served - opened < 10  # the exporter's retries run in its own thread
    assert time.monotonic() - served < 10  # stopping waits for the queued spans a bounded time
    assert time.monotonic() - started < 120


def test_steps_waiting_for_their_spans_are_bounded(receiver: Receiver) -> None:
    """A tracer thread that falls behind drops the oldest steps instead of growing; the newest
    still become spans with the ids their requests were given."""
    tracer = StepTracer(receiver.endpoint)
    output = SchedulerOutput(step_id=1, requests=[], num_scheduled_tokens=0, preempted_req_ids=[], finished_req_ids=[])
    now = time.monotonic_ns()
    with tracer._lock:  # the thread cannot drain meanwhile
        refs = [
            tracer.record(StepMarks(output, now, now), StepResult(1, {}), now) for _ in range(MAX_PENDING_STEPS + 10)
        ]
        assert len(tracer._pending) == MAX_PENDING_STEPS
    tracer.flush()
    spans = receiver.spans_by_id({span_id(ref) for ref in refs[-MAX_PENDING_STEPS:]})
    assert {s.trace_id for s in spans.values()} == {ref.trace_id for ref in refs[-MAX_PENDING_STEPS:]}
    assert not {span_id(ref) for ref in refs[:10]} & {s.span_id for s in receiver.spans}
