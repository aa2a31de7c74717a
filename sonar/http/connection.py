"""The HTTP connection guard: uvicorn's h11 protocol with the two limits uvicorn lacks.

* **Header read timeout** (--header-read-timeout): from the moment a connection opens, or the
  first byte of a keep-alive connection's next request arrives, the request's headers must be
  complete within the timeout; otherwise the server answers 408 and closes the connection. A
  client that opens connections and trickles partial headers (slowloris) holds each for at most
  that long. (uvicorn closes idle keep-alive connections itself, after --timeout-keep-alive's 5 s,
  but never one that sent part of a request.)
* **Connection cap** (--max-connections): a connection opened while that many are already open
  gets a 503 in the OpenAI error shape for its request and is closed.
* **Lingering close.** A response that ends a connection while the client is still sending its
  body (a 413 for a chunked body past --max-request-body-bytes, a 408) half-closes first: the
  server sends its FIN after the response, then reads and drops what still comes for up to
  `LINGER_SECONDS` or `LINGER_BYTES`, and only then closes. Closing a socket with unread bytes
  makes the kernel send a reset, which throws away the response the client has not read yet.

The request body has its own limits (size, read timeout): see `sonar.http.app.BodyLimits`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
import msgspec
from uvicorn.protocols.http.h11_impl import H11Protocol

from sonar.http.errors import error_body, error_response
from sonar.log import get_logger

log = get_logger("sonar.http")

#: How long, and how many bytes of a refused body, a half-closed connection is drained before it
#: closes: enough for the client to read the response, too little to keep the server busy.
LINGER_SECONDS = 1.0
LINGER_BYTES = 1 << 20


def guarded_protocol(header_timeout: float, max_connections: int) -> type[H11Protocol]:
    """The uvicorn protocol class (`uvicorn.Config(http=...)`) that enforces both limits."""
    timeout_body = msgspec.json.encode(
        error_body(f"the request headers did not arrive within {header_timeout:g} s (--header-read-timeout)", 408)
    )
    timeout_response = (
        b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(timeout_body), timeout_body)
    )
    over_capacity = error_response(
        f"the server has {max_connections} connections open, its limit (--max-connections); retry later", 503
    )
    over_capacity.headers["connection"] = "close"

    class GuardedH11Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.header_timer: asyncio.TimerHandle | None = None
            self.linger_timer: asyncio.TimerHandle | None = None
            self.drained = 0

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(_LingeringTransport(transport, self))  # type: ignore[arg-type]
            if len(self.connections) > max_connections:
                log.warning(
                    "http.connection_refused",
                    client=_client(self.client),
                    limit=max_connections,
                    detail="--max-connections reached; answering 503",
                )
                self.app = over_capacity
            self._await_headers()

        def data_received(self, data: bytes) -> None:
            if self.linger_timer is not None:  # the response is out: what still comes is dropped
                self.drained += len(data)
                if self.drained > LINGER_BYTES:
                    self.transport.close()
                return
            if self.header_timer is None and self.conn.their_state is h11.IDLE:
                self._await_headers()  # the first bytes of a keep-alive connection's next request
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._headers_done()

        def connection_lost(self, exc: Exception | None) -> None:
            self._headers_done()
            if self.linger_timer is not None:
                self.linger_timer.cancel()
            super().connection_lost(exc)

        def linger(self, raw: asyncio.Transport) -> bool:
            """Half-close `raw` and drain it a while, if the client is still sending its request
            body; False when a plain close is right."""
            if self.linger_timer is not None or self.conn.their_state is not h11.SEND_BODY or not raw.can_write_eof():
                return False
            raw.write_eof()
            raw.resume_reading()  # uvicorn may have paused it while the body piled up
            self.linger_timer = self.loop.call_later(LINGER_SECONDS, raw.close)
            return True

        def _await_headers(self) -> None:
            self.header_timer = self.loop.call_later(header_timeout, self._header_timeout)

        def _headers_done(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def _header_timeout(self) -> None:
            self.header_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            log.debug("http.header_timeout", client=_client(self.client), timeout=header_timeout)
            # h11 cannot send a response to a request it has not parsed: the bytes are written as is.
            self.transport.write(timeout_response)
            self.transport.close()

    return GuardedH11Protocol


class _LingeringTransport:
    """The connection's transport as uvicorn sees it: `close()` lingers (see the module docstring)
    when the protocol says the client is still sending; everything else is the transport's."""

    def __init__(self, raw: asyncio.Transport, protocol: Any) -> None:
        self._raw = raw
        self._protocol = protocol

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)

    def close(self) -> None:
        if self._raw.is_closing() or not self._protocol.linger(self._raw):
            self._raw.close()

    def is_closing(self) -> bool:
        return self._raw.is_closing() or self._protocol.linger_timer is not None


def _client(client: tuple[str, int] | None) -> str | None:
    return None if client is None else f"{client[0]}:{client[1]}"
