"""Concurrency for the endpoints: a call cancelled when its client leaves (several calls at once:
`sonar.engine.gather`)."""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import anyio

from sonar.log import get_logger

log = get_logger("sonar.http")


async def cancel_on_disconnect(
    request: Any, call: Callable[[], Awaitable[Any]], request_id: str | None = None
) -> tuple[bool, Any]:
    """Await `call()` unless the client disconnects first; then cancel it (leaving the engine's
    `generate` aborts the request). Returns (finished, result); `call`'s exception is raised as is.

    Needs the request body read already: `receive()` then waits for the disconnect only.
    """
    outcome: list[Any] = []

    async def run() -> None:
        try:
            outcome.append((True, await call()))
        except Exception as exc:
            outcome.append(exc)
        tg.cancel_scope.cancel()

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        log.info("request.disconnected", request_id=request_id, detail="client gone; request aborted")
        tg.cancel_scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        tg.start_soon(run)
    if not outcome:
        return False, None
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    return outcome[0]
