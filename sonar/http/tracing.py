"""OpenTelemetry tracing (``--otlp-traces-endpoint``): one span per finished engine request.

A generation request (completion, chat completion, response) ends in one ``llm_request`` span per
engine request, i.e. per prompt and choice, named and attributed as vLLM's (``gen_ai.*``): the
request id, the model, the sampling parameters, the token counts and the latencies. The latencies
come from what `RequestRecorder` already measures: the scheduler's `RequestTiming` (queue time,
and scheduling to first token: the prefill) and the frontend's arrival, first and last token.

The client's W3C ``traceparent`` (and ``tracestate``) header makes the span a child of the
client's trace. With ``--collect-detailed-traces`` the span adds the request's worker time
(``gen_ai.latency.time_in_model_execute`` for ``worker``, ``time_in_model_forward`` for ``model``),
summed by the scheduler over the steps the request was in (`RequestModelTime`), and links to the
scheduler's ``scheduler.step`` spans of the first `MAX_STEP_LINKS` of those steps
(`sonar.engine.step_spans`; ``sonar.steps`` counts them all).

Spans go out over OTLP/HTTP (protobuf) from the SDK's `BatchSpanProcessor` (`sonar.engine.otlp`):
ending a span only appends it to a bounded queue, so a slow or absent collector never blocks the
event loop or fails a request.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sonar.core.outputs import RequestModelTime, RequestTiming, StepRef
from sonar.engine.otlp import TracingConfigError, otlp_provider, traces_url

__all__ = ["SpanTimes", "TracingConfigError", "RequestTracer", "span_attributes", "traces_url"]

SPAN_NAME = "llm_request"


@dataclass
class SpanTimes:
    """One engine request's times on the frontend's clock (`time.monotonic`), and the scheduler's
    `RequestTiming` when its first token arrived."""

    arrival: float
    end: float
    first: float | None = None
    last: float | None = None
    timing: RequestTiming | None = None
    model_time: RequestModelTime | None = None
    """--collect-detailed-traces: the request's worker time, from its last update."""
    steps: list[StepRef] = field(default_factory=list)
    """--collect-detailed-traces: the step spans the request's span links to (the first
    `MAX_STEP_LINKS` steps it was in)."""


def span_attributes(
    request_id: str,
    model: str,
    params: Any,
    prompt_tokens: int,
    completion_tokens: int,
    times: SpanTimes,
    finish_reason: str | None,
) -> dict[str, Any]:
    """The span's attributes (vLLM's ``gen_ai.*`` names; latencies in seconds). A latency that was
    never reached (a request aborted before its first token) is left out."""
    attrs: dict[str, Any] = {
        "gen_ai.request.id": request_id,
        "gen_ai.response.model": model,
        "gen_ai.request.temperature": float(params.temperature),
        "gen_ai.request.top_p": float(params.top_p),
        "gen_ai.request.n": int(params.n),
        "gen_ai.usage.prompt_tokens": prompt_tokens,
        "gen_ai.usage.completion_tokens": completion_tokens,
        "gen_ai.latency.e2e": times.end - times.arrival,
    }
    if params.max_tokens is not None:
        attrs["gen_ai.request.max_tokens"] = int(params.max_tokens)
    if finish_reason is not None:
        attrs["gen_ai.response.finish_reasons"] = [finish_reason]
    if times.first is not None:
        attrs["gen_ai.latency.time_to_first_token"] = times.first - times.arrival
    decode = times.last - times.first if times.first is not None and times.last is not None else None
    if decode is not None:
        attrs["gen_ai.latency.time_in_model_decode"] = decode
    if times.timing is not None:
        attrs["gen_ai.latency.time_in_queue"] = times.timing.queue_seconds
        attrs["gen_ai.latency.time_in_model_prefill"] = times.timing.first_token_seconds
        if decode is not None:
            attrs["gen_ai.latency.time_in_model_inference"] = times.timing.first_token_seconds + decode
    if times.model_time is not None:
        if times.model_time.execute_seconds is not None:
            attrs["gen_ai.latency.time_in_model_execute"] = times.model_time.execute_seconds
        if times.model_time.forward_seconds is not None:
            attrs["gen_ai.latency.time_in_model_forward"] = times.model_time.forward_seconds
        if times.model_time.steps:
            attrs["sonar.steps"] = times.model_time.steps
            attrs["sonar.steps.linked"] = len(times.steps)
    return attrs


def _wall_ns(monotonic: float, now_mono: float, now_ns: int) -> int:
    return now_ns - int((now_mono - monotonic) * 1e9)


class RequestTracer:
    """The app's tracer provider and exporter (one per app; never the SDK's global provider)."""

    def __init__(self, endpoint: str, service_name: str = "sonar") -> None:
        from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.url = traces_url(endpoint)
        self.provider = otlp_provider(endpoint, service_name)
        self.tracer = self.provider.get_tracer("sonar")
        self._kind = SpanKind.SERVER
        self._propagator = TraceContextTextMapPropagator()
        self._link, self._context, self._sampled = Link, SpanContext, TraceFlags(TraceFlags.SAMPLED)

    def parent(self, headers: Mapping[str, str]) -> Any:
        """The trace context of a request's ``traceparent`` header (an empty context without one,
        or with a malformed one: the span then starts a trace of its own)."""
        return self._propagator.extract(carrier={k.lower(): v for k, v in headers.items()})

    def record(self, parent: Any, attributes: dict[str, Any], times: SpanTimes) -> None:
        """Queue one finished request's span for export (never blocks)."""
        now_mono, now_ns = time.monotonic(), time.time_ns()
        span = self.tracer.start_span(
            SPAN_NAME,
            context=parent,
            kind=self._kind,
            attributes=attributes,
            start_time=_wall_ns(times.arrival, now_mono, now_ns),
            links=[self._step_link(ref) for ref in times.steps],
        )
        span.end(end_time=_wall_ns(times.end, now_mono, now_ns))

    def _step_link(self, ref: StepRef) -> Any:
        context = self._context(
            int.from_bytes(ref.trace_id, "big"), ref.span_id, is_remote=True, trace_flags=self._sampled
        )
        return self._link(context)

    def shutdown(self) -> None:
        """Export what is queued (bounded by the export timeout) and stop the exporter."""
        self.provider.shutdown()
