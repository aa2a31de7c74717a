"""A server-sent-events response that aborts its work when the client goes away.

`EventStream(produce, request_id)` runs `produce(emit)`; each `emit(obj)` sends `data: <json>`, and
`emit(obj, event)` sends it under an `event: <event>` line (the Responses API names its events).
The status line and headers go out with the first event, so an error raised before any event
(a bad parameter, a prompt too long for the model) is raised on to the app's exception handler
(`sonar.http.errors`) and answered as an ordinary JSON error with its proper status. An error
after the first event is sent as a `data: {"error": ...}` event with the same body.
The stream ends with `data: [DONE]` (unless `done_marker` is false: the Responses API ends with
its last event).

While `produce` runs, a second task listens for `http.disconnect`; a client that disconnects
cancels `produce`, which leaves `LLM.stream` early and so aborts the engine request.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Protocol

import anyio
import msgspec
from starlette.types import Receive, Scope, Send

from sonar.http.errors import error_from_exception
from sonar.log import get_logger

log = get_logger("sonar.http")


class Emit(Protocol):
    def __call__(self, obj: Any, event: str | None = None) -> Awaitable[None]: ...


_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class EventStream:
    def __init__(
        self, produce: Callable[[Emit], Awaitable[None]], request_id: str, *, done_marker: bool = True
    ) -> None:
        self.produce = produce
        self.request_id = request_id
        self.done_marker = done_marker

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False
        disconnected = False
        lock = anyio.Lock()

        async def send_data(data: bytes, event: str | None = None) -> None:
            nonlocal started
            head = b"event: " + event.encode() + b"\n" if event else b""
            async with lock:
                if not started:
                    await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
                    started = True
                await send({"type": "http.response.body", "body": head + b"data: " + data + b"\n\n", "more_body": True})

        async def emit(obj: Any, event: str | None = None) -> None:
            await send_data(msgspec.json.encode(obj), event)

        async def watch_disconnect() -> None:
            nonlocal disconnected
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    disconnected = True
                    tg.cancel_scope.cancel()
                    return

        error: Exception | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_disconnect)
            try:
                await self.produce(emit)
            except OSError:  # the transport failed under us: the client is gone
                disconnected = True
            except Exception as exc:
                error = exc
            tg.cancel_scope.cancel()
        if disconnected:
            log.info("request.disconnected", request_id=self.request_id, detail="client gone; request aborted")
            return
        if error is not None and not started:
            raise error
        try:
            if error is not None:
                await emit(error_from_exception(error, self.request_id)[1], None if self.done_marker else "error")
            if self.done_marker:
                await send_data(b"[DONE]")
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass
