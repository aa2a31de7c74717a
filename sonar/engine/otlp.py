"""OpenTelemetry export over OTLP/HTTP, shared by the frontend's request spans
(`sonar.http.tracing`) and the scheduler's step spans (`sonar.engine.step_spans`).

Spans go out from the SDK's `BatchSpanProcessor`: ending a span only appends it to a bounded
queue (a full queue drops it), and a background thread posts the batches, so a slow or absent
collector never blocks the caller's loop. The OpenTelemetry SDK is imported only when a provider
is made: without tracing it stays unloaded.
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from sonar.errors import SonarError

__all__ = ["TracingConfigError", "epoch_ns", "otlp_provider", "traces_url"]

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


def otlp_provider(endpoint: str, service_name: str = "sonar", id_generator: Any = None) -> Any:
    """A tracer provider of its own (never the SDK's global one) exporting to `endpoint` (made a
    URL by `traces_url`) behind a bounded `BatchSpanProcessor`; `id_generator`: the SDK's random
    one unless given."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}), id_generator=id_generator)
    exporter = OTLPSpanExporter(endpoint=traces_url(endpoint), timeout=EXPORT_TIMEOUT_S)
    provider.add_span_processor(
        BatchSpanProcessor(
            exporter,
            max_queue_size=MAX_QUEUED_SPANS,
            schedule_delay_millis=EXPORT_DELAY_MS,
            export_timeout_millis=int(EXPORT_TIMEOUT_S * 1000),
        )
    )
    return provider


def epoch_ns(monotonic_ns: int, now: tuple[int, int] | None = None) -> int:
    """A `time.monotonic_ns` reading as nanoseconds since the epoch, by the offset between the two
    clocks at `now` (``(monotonic_ns, time_ns)``, read together; read here when not given): the
    durations stay the monotonic clock's, immune to a wall clock stepped meanwhile."""
    mono, wall = now if now is not None else (time.monotonic_ns(), time.time_ns())
    return wall - (mono - monotonic_ns)


def clock_pair() -> tuple[int, int]:
    """``(time.monotonic_ns(), time.time_ns())`` read together, for `epoch_ns`."""
    return time.monotonic_ns(), time.time_ns()
