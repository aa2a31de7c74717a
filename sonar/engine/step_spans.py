"""--collect-detailed-traces with an OTLP endpoint: one span per engine step, exported by the
scheduler.

Each step the scheduler ran becomes a ``scheduler.step`` span, a trace of its own, from the start
of its scheduling to the moment its result was fed back, with the step's composition as
attributes (`step_attributes`: batch size, tokens scheduled, the prefill/decode split,
preemptions, tokens sampled) and, as children, ``scheduler.schedule`` (the scheduler core's
`schedule()` call) and the parts the worker timed itself and sent in its `StepResult.spans`:
``worker.execute`` and ``worker.sample`` with ``worker`` (or ``all``), ``model.forward`` with
``model`` (or ``all``). Every time is a monotonic clock reading of the process that took it,
converted to the epoch there (`sonar.engine.otlp.epoch_ns`).

A request's ``llm_request`` span (the frontend's, `sonar.http.tracing`) links to the steps that
served it: the scheduler sends each request, with its updates, the `StepRef` of its steps, up to
`MAX_STEP_LINKS` of them (the first ones: the prefill and the start of the decode); the count of
all its steps goes along. Trace volume is thus one span per step plus up to three children,
whatever the batch size, and a bounded number of links per request.

The step loop only picks a finished step's span ids and queues it (a few microseconds): a thread
of the tracer makes the spans (tens of microseconds each with the SDK) every 50 ms, and the SDK's
batch processor queues them (a full queue drops them) for its own thread to post. One tracer per
process and endpoint serves every scheduler incarnation there (a restarted scheduler starts no
other thread).
"""

from __future__ import annotations

import atexit
import random
import threading
import time
from collections import deque
from typing import Any

from sonar.core.outputs import SchedulerOutput, StepRef
from sonar.engine.otlp import clock_pair, epoch_ns, otlp_provider
from sonar.protocol.engine import StepResult

__all__ = ["MAX_STEP_LINKS", "StepMarks", "StepTracer", "iteration_details", "step_attributes", "step_tracer"]

STEP_SPAN = "scheduler.step"
SCHEDULE_SPAN = "scheduler.schedule"
#: The steps a request's span links to at most (its first ones).
MAX_STEP_LINKS = 32
#: Seconds a stopping scheduler waits for its queued spans to go out.
FLUSH_TIMEOUT_S = 2.0
#: Finished steps waiting for their spans to be made at most (past it, the oldest are dropped), and
#: how often the tracer's thread makes them.
MAX_PENDING_STEPS = 1024
DRAIN_INTERVAL_S = 0.05


def iteration_details(output: SchedulerOutput) -> dict[str, int]:
    """A step's composition, as vLLM's iteration log counts it: context requests (computing prompt
    tokens: a prefill or a chunk of one, or a recompute after preemption) and their tokens, and
    generation requests (decoding, drafts included) and their tokens."""
    context_requests = context_tokens = generation_requests = generation_tokens = 0
    for sched in output.requests:
        if sched.start_pos < sched.num_prompt_tokens:
            context_requests += 1
            context_tokens += len(sched.token_ids)
        else:
            generation_requests += 1
            generation_tokens += len(sched.token_ids)
    return {
        "context_requests": context_requests,
        "context_tokens": context_tokens,
        "generation_requests": generation_requests,
        "generation_tokens": generation_tokens,
    }


def step_attributes(output: SchedulerOutput, result: StepResult) -> dict[str, Any]:
    """A step's composition as span attributes (`iteration_details`: a request counts as prefill
    while it computes prompt tokens, a prefill chunk or a recompute after a preemption, else as
    decode, drafts included); ``sampled_tokens`` are the tokens the worker sampled and kept."""
    details = iteration_details(output)
    return {
        "sonar.step.id": output.step_id,
        "sonar.step.batch_size": len(output.requests),
        "sonar.step.tokens": output.num_scheduled_tokens,
        "sonar.step.prefill_requests": details["context_requests"],
        "sonar.step.prefill_tokens": details["context_tokens"],
        "sonar.step.decode_requests": details["generation_requests"],
        "sonar.step.decode_tokens": details["generation_tokens"],
        "sonar.step.preemptions": len(output.preempted_req_ids),
        "sonar.step.sampled_tokens": sum(len(tokens) for tokens in result.sampled.values()),
        "sonar.step.failed_requests": len(result.failed),
        "sonar.step.worker_seconds": result.seconds,
    }


class StepMarks:
    """One step's scheduler-side times (`time.monotonic_ns`) and its scheduled work."""

    __slots__ = ("output", "schedule_start", "schedule_end")

    def __init__(self, output: SchedulerOutput, schedule_start: int, schedule_end: int) -> None:
        self.output = output
        self.schedule_start = schedule_start
        self.schedule_end = schedule_end


class _ChosenIds:
    """The provider's id generator: a step span's ids are chosen when the step ends, on the
    scheduler's loop (its requests link to them at once), and taken here when the span is made,
    later, by the tracer's thread; every other span id is random."""

    def __init__(self) -> None:
        from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

        self._random = RandomIdGenerator()
        self.trace_id = 0
        self.span_id = 0

    def generate_trace_id(self) -> int:
        return self.trace_id

    def generate_span_id(self) -> int:
        span_id, self.span_id = self.span_id, 0
        return span_id or self._random.generate_span_id()

    def is_trace_id_random(self) -> bool:
        return True


class StepTracer:
    """Queues finished steps on the scheduler's loop (no span is made there: `record` only picks
    the step span's ids and appends) and makes their spans on a thread of its own, every
    `DRAIN_INTERVAL_S`, for the SDK's batch processor to export."""

    def __init__(self, endpoint: str) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind

        self._ids = _ChosenIds()
        self.provider = otlp_provider(endpoint, id_generator=self._ids)
        self.tracer = self.provider.get_tracer("sonar.scheduler")
        self._kind = SpanKind.INTERNAL
        self._child_of = trace.set_span_in_context
        self._pending: deque[tuple[int, int, StepMarks, StepResult, int]] = deque(maxlen=MAX_PENDING_STEPS)
        self._lock = threading.Lock()  # one maker of spans at a time: `_ids` is shared state
        self._thread = threading.Thread(target=self._drain_forever, name="sonar-step-spans", daemon=True)
        self._thread.start()
        atexit.register(self._drain)  # before the provider's own exit flush (atexit runs last first)

    def record(self, marks: StepMarks, result: StepResult, end: int) -> StepRef:
        """Queue a step's span and its children; `end` (`time.monotonic_ns`) is when its result
        was fed back. The reference its requests' spans link to."""
        trace_id, span_id = random.getrandbits(128) or 1, random.getrandbits(64) or 1
        self._pending.append((trace_id, span_id, marks, result, end))  # full: the oldest step is dropped
        return StepRef(trace_id.to_bytes(16, "big"), span_id)

    def flush(self) -> None:
        """Make the queued steps' spans and send them, waiting at most `FLUSH_TIMEOUT_S` for the
        collector (blocking: call it in a thread)."""
        self._drain()
        self.provider.force_flush(timeout_millis=int(FLUSH_TIMEOUT_S * 1000))

    def _drain_forever(self) -> None:
        while True:
            time.sleep(DRAIN_INTERVAL_S)
            self._drain()

    def _drain(self) -> None:
        with self._lock:
            now = clock_pair()  # the monotonic readings are this process's: one offset for all
            while self._pending:
                self._make(*self._pending.popleft(), now)

    def _make(self, trace_id: int, span_id: int, marks: StepMarks, result: StepResult, end: int, now: Any) -> None:
        self._ids.trace_id, self._ids.span_id = trace_id, span_id
        span = self.tracer.start_span(
            STEP_SPAN,
            kind=self._kind,
            attributes=step_attributes(marks.output, result),
            start_time=epoch_ns(marks.schedule_start, now),
        )
        parent = self._child_of(span)
        schedule = self.tracer.start_span(
            SCHEDULE_SPAN, context=parent, kind=self._kind, start_time=epoch_ns(marks.schedule_start, now)
        )
        schedule.end(end_time=epoch_ns(marks.schedule_end, now))
        for part in result.spans:  # already epoch times: converted in the worker's process
            child = self.tracer.start_span(part.name, context=parent, kind=self._kind, start_time=part.start_ns)
            child.end(end_time=part.end_ns)
        span.end(end_time=epoch_ns(end, now))


_tracers: dict[str, StepTracer] = {}
_tracers_lock = threading.Lock()


def step_tracer(endpoint: str) -> StepTracer:
    """This process's step tracer for `endpoint` (made on first use; the SDK's provider flushes
    it when the interpreter exits)."""
    with _tracers_lock:
        tracer = _tracers.get(endpoint)
        if tracer is None:
            tracer = _tracers[endpoint] = StepTracer(endpoint)
        return tracer
