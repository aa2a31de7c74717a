"""The server's phases (starting, serving, draining, dead) and the ASGI front door that enforces them."""

from __future__ import annotations

import secrets
from typing import Any

import anyio

from sonar.http.errors import error_response
from sonar.log import get_logger

log = get_logger("sonar.http")


class Drain:
    """Where the server is in its life, and the requests in flight.

    `phase` is "starting" (the engine is loading: every route answers 503), "serving",
    "draining" (SIGTERM: new requests get 503 while those in flight finish, then the rest are
    aborted with `abort_all`) or "dead" (the engine gave up: 503 with `reason`)."""

    def __init__(self) -> None:
        self.phase = "starting"
        self.reason = ""
        self.in_flight = 0

    async def wait_idle(self, poll: float = 0.05) -> None:
        while self.in_flight:
            await anyio.sleep(poll)


async def abort_all(llm: Any) -> list[str]:
    """`llm.abort_all()`, tolerating an engine that is already going away."""
    try:
        return await llm.abort_all()
    except Exception as exc:  # the engine is going away anyway
        log.warning("shutdown.abort_failed", detail=f"{type(exc).__name__}: {exc}")
        return []


UNAVAILABLE = {
    "starting": "the server is starting: the engine is not ready yet",
    "draining": "the server is shutting down and accepts no new requests",
    "dead": "the engine is not available",
}


class FrontDoor:
    """The ASGI wrapper around the app: answers 431 to a request with too many headers and 503
    unless the server is serving, counts requests in flight for `Drain`, and adds `X-Request-Id`
    headers when asked to. `app` is set once the
    engine is ready (None while starting)."""

    def __init__(
        self, app: Any, drain: Drain, request_id_headers: bool = False, max_header_count: int | None = None
    ) -> None:
        self.app = app
        self.drain = drain
        self.request_id_headers = request_id_headers
        self.max_header_count = max_header_count

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            if self.app is not None:
                await self.app(scope, receive, send)
            return
        if self.request_id_headers:
            send = self._with_request_id(scope, send)
        if self.max_header_count is not None and len(scope.get("headers", ())) > self.max_header_count:
            response = error_response(
                f"the request has more than {self.max_header_count} headers (--h11-max-header-count)", 431
            )
            response.headers["connection"] = "close"
            await response(scope, receive, send)
            return
        drain = self.drain
        if drain.phase != "serving" or self.app is None:
            message = UNAVAILABLE.get(drain.phase, UNAVAILABLE["starting"])
            if drain.reason:
                message = f"{message}: {drain.reason}"
            response = error_response(message, 503)
            response.headers["connection"] = "close"
            await response(scope, receive, send)
            return
        drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            drain.in_flight -= 1

    @staticmethod
    def _with_request_id(scope: Any, send: Any) -> Any:
        given = next((v for k, v in scope.get("headers", ()) if k.lower() == b"x-request-id"), None)
        rid = given or secrets.token_hex(16).encode()

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"x-request-id"]
                message = {**message, "headers": headers + [(b"x-request-id", rid)]}
            await send(message)

        return send_with_id
