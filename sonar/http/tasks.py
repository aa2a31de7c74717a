"""Concurrency for the endpoints: several engine calls at once, a call cancelled when its client leaves."""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Sequence

import anyio

from sonar.log import get_logger

log = get_logger("sonar.http")


async def gather(calls: Sequence[Callable[[], Awaitable[Any]]]) -> list[Any]:
    """Await the calls concurrently; results in order. The first failure cancels the rest and is
    raised as itself (not inside an exception group)."""
    if len(calls) == 1:
        return [await calls[0]()]
    results: list[Any] = [None] * len(calls)
    errors: list[Exception] = []

    async def one(i: int) -> None:
        try:
            results[i] = await calls[i]()
        except Exception as exc:
            errors.append(exc)
            tg.cancel_scope.cancel()

    async with anyio.create_task_group() as tg:
        for i in range(len(calls)):
            tg.start_soon(one, i)
    if errors:
        raise errors[0]
    return results


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
