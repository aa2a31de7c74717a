"""The client actor: where the detokenizer sends a library client's outputs.

It routes each `OutputDelta` to the stream of the request it belongs to (a `DeltaStream`), and an
`EngineFailed` to the streams of the requests the engine lost (as `Failed`); the `LLM` handle reads
the streams (where it also puts `Moved` for the requests of a lost replica).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import anyio

from sonar.actors import Actor
from sonar.protocol.engine import EngineFailed, FrontendMsg, Outputs


class Failed:
    """On a request's stream: the engine cannot finish it (`reason` says why)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class Moved:
    """On a request's stream: replica `replica` was lost; the request goes on elsewhere
    (`sonar.engine.replay`)."""

    def __init__(self, replica: int, reason: str) -> None:
        self.replica = replica
        self.reason = reason


class DeltaStream:
    """One request's outputs on their way from the client actor to the task that reads them: an
    unbounded queue whose reader waits on an event only while it is empty.

    Every running request gets an item each step, so this is per-step work times the running
    requests: an anyio memory object stream costs about twice as much per item (a checkpoint in
    every receive, an exception in every wait), ~2 ms of each step at 256 running requests.
    """

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[Any] = deque()
        self._waiter: anyio.Event | None = None

    def send_nowait(self, item: Any) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            waiter.set()

    async def receive(self) -> Any:
        """The next item, in the order sent; waits (cancellably) while there is none."""
        while not self._items:
            self._waiter = anyio.Event()
            await self._waiter.wait()
        return self._items.popleft()


class ClientActor(Actor):
    """Receives `Outputs` and routes each delta to the stream of the request it belongs to."""

    protocol = FrontendMsg

    def __init__(self, streams: dict[str, DeltaStream]) -> None:
        self.streams = streams

    async def handle(self, msg: FrontendMsg) -> Any:
        if isinstance(msg, Outputs):
            for delta in msg.deltas:
                stream = self.streams.get(delta.req_id)
                if stream is not None:
                    stream.send_nowait(delta)
        elif isinstance(msg, EngineFailed):
            for rid in msg.request_ids:
                stream = self.streams.get(rid)
                if stream is not None:
                    stream.send_nowait(Failed(msg.reason))
        return None
