"""Several engine calls at once, for a request that carries several prompts (HTTP batches, scores)."""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Sequence

import anyio


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
