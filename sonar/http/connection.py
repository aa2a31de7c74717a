"""The HTTP connection guard: uvicorn's h11 protocol with the two limits uvicorn lacks.

* **Header read timeout** (--header-read-timeout): from the moment a connection opens, or the
  first byte of a keep-alive connection's next request arrives, the request's headers must be
  complete within the timeout; otherwise the server answers 408 and closes the connection. A
  client that opens connections and trickles partial headers (slowloris) holds each for at most
  that long. (uvicorn closes idle keep-alive connections itself, after --timeout-keep-alive's 5 s,
  but never one that sent part of a request.)
* **Connection cap** (--max-connections): a connection opened while that many are already open
  gets a 503 in the OpenAI error shape for its request and is closed.

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


def guarded_protocol(header_timeout: float, max_connections: int) -> type[H11Protocol]:
    """The uvicorn protocol class (`uvicorn.Config(http=...)`) that enforces both limits."""
    timeout_body = msgspec.json.encode(error_body(
        f"the request headers did not arrive within {header_timeout:g} s (--header-read-timeout)", 408))
    timeout_response = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                        b"content-length: %d\r\n\r\n%s" % (len(timeout_body), timeout_body))
    over_capacity = error_response(f"the server has {max_connections} connections open, its limit "
                                   "(--max-connections); retry later", 503)
    over_capacity.headers["connection"] = "close"

    class GuardedH11Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                log.warning("http.connection_refused", client=_client(self.client), limit=max_connections,
                            detail="--max-connections reached; answering 503")
                self.app = over_capacity
            self._await_headers()

        def data_received(self, data: bytes) -> None:
            if self.header_timer is None and self.conn.their_state is h11.IDLE:
                self._await_headers()  # the first bytes of a keep-alive connection's next request
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._headers_done()

        def connection_lost(self, exc: Exception | None) -> None:
            self._headers_done()
            super().connection_lost(exc)

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


def _client(client: tuple[str, int] | None) -> str | None:
    return None if client is None else f"{client[0]}:{client[1]}"
