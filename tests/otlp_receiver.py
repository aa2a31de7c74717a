"""A real OTLP/HTTP trace receiver for the tracing tests: an HTTP server taking POST /v1/traces,
whose protobuf bodies are decoded with `opentelemetry.proto`."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Receiver:
    """An OTLP/HTTP trace receiver: every span posted to /v1/traces, decoded, with its resource."""

    def __init__(self, port: int | None = None) -> None:
        self.spans: list[Any] = []
        self.resources: list[Any] = []
        self.paths: list[str] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                export = ExportTraceServiceRequest()
                export.ParseFromString(body)
                with receiver.lock:
                    receiver.paths.append(self.path)
                    for rs in export.resource_spans:
                        receiver.resources.append(rs.resource)
                        for ss in rs.scope_spans:
                            receiver.spans.extend(ss.spans)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port or free_port()), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        """The collector's URL without a path (the exporters add /v1/traces)."""
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def wait_for(self, where: Callable[[Any], bool], count: int = 1, timeout: float = 15.0) -> list[Any]:
        """The spans `where` accepts, once at least `count` of them arrived."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                found = [s for s in self.spans if where(s)]
            if len(found) >= count:
                return found
            assert time.monotonic() < deadline, f"{len(found)} spans arrived, not {count}"
            time.sleep(0.1)

    def spans_of(self, request_id: str, count: int = 1, timeout: float = 15.0) -> list[Any]:
        """The spans whose ``gen_ai.request.id`` is `request_id`, once `count` of them arrived."""
        return self.wait_for(lambda s: attributes(s).get("gen_ai.request.id") == request_id, count, timeout)

    def spans_by_id(self, span_ids: set[bytes], timeout: float = 15.0) -> dict[bytes, Any]:
        """The spans of these ids, once all arrived."""
        found = self.wait_for(lambda s: s.span_id in span_ids, len(span_ids), timeout)
        return {s.span_id: s for s in found}

    def children_of(self, span: Any) -> list[Any]:
        with self.lock:
            return [s for s in self.spans if s.parent_span_id == span.span_id and s.trace_id == span.trace_id]


def attributes(span: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in span.attributes:
        v = kv.value
        kind = v.WhichOneof("value")
        out[kv.key] = [x.string_value for x in v.array_value.values] if kind == "array_value" else getattr(v, kind)
    return out
