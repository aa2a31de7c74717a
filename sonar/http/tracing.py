"""OpenTelemetry tracing (``--otlp-traces-endpoint``): one span per finished engine request.

A generation request (completion, chat completion, response) ends in one ``llm_request`` span per
engine request, i.e. per prompt and choice, named and attributed as vLLM's (``gen_ai.*``): the
request id, the model, the sampling parameters, the token counts and the latencies. The latencies
come from what `RequestRecorder` already measures: the scheduler's `RequestTiming` (queue time,
and scheduling to first token: the prefill) and the frontend's arrival, first and last token.

The client's W3C ``traceparent`` (and ``tracestate``) header makes the span a child of the
client's trace. With ``--collect-detailed-traces`` the span adds the request's worker time
(``gen_ai.latency.time_in_model_execute`` for ``worker``, ``time_in_model_forward`` for ``model``),
summed by the scheduler over the steps the request was in (`RequestModelTime`).

Spans go out over OTLP/HTTP (protobuf) from the SDK's `BatchSpanProcessor`: ending
a span only appends it to a bounded queue (a full queue drops it), and a background thread posts
the batches, so a slow or absent collector never blocks the event loop or fails a request.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from sonar.core.outputs import RequestModelTime, RequestTiming
from sonar.errors import SonarError

__all__ = ["SpanTimes", "TracingConfigError", "RequestTracer", "span_attributes", "traces_url"]

SPAN_NAME = "llm_request"
#: Spans held for export at most; past it, spans are dropped rather than memory grown.
MAX_QUEUED_SPANS = 2048
EXPORT_DELAY_MS = 500
EXPORT_TIMEOUT_S = 5.0


class TracingConfigError(SonarError):
    """--otlp-traces-endpoint is not an http(s) URL."""


def traces_url(endpoint: str) -> str:
    """The URL spans are posted to: `endpoint` as given, with OTLP's ``/v1/traces`` path added when
    it names no path (``http://collector:4318``)."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise TracingConfigError(
            f"{endpoint!r} is not the http:// or https:// URL of an OTLP/HTTP collector (Sonar exports "
            "OTLP over HTTP with protobuf; gRPC is not supported)"
        )
    if parts.path in ("", "/"):
        parts = parts._replace(path="/v1/traces")
    return urlunsplit(parts)


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
    return attrs


def _wall_ns(monotonic: float, now_mono: float, now_ns: int) -> int:
    return now_ns - int((now_mono - monotonic) * 1e9)


class RequestTracer:
    """The app's tracer provider and exporter (one per app; never the SDK's global provider)."""

    def __init__(self, endpoint: str, service_name: str = "sonar") -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.url = traces_url(endpoint)
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        exporter = OTLPSpanExporter(endpoint=self.url, timeout=EXPORT_TIMEOUT_S)
        self.provider.add_span_processor(
            BatchSpanProcessor(
                exporter,
                max_queue_size=MAX_QUEUED_SPANS,
                schedule_delay_millis=EXPORT_DELAY_MS,
                export_timeout_millis=int(EXPORT_TIMEOUT_S * 1000),
            )
        )
        self.tracer = self.provider.get_tracer("sonar")
        self._kind = SpanKind.SERVER
        self._propagator = TraceContextTextMapPropagator()

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
        )
        span.end(end_time=_wall_ns(times.end, now_mono, now_ns))

    def shutdown(self) -> None:
        """Export what is queued (bounded by the export timeout) and stop the exporter."""
        self.provider.shutdown()
