"""The client actor: where the detokenizer sends a library client's outputs.

It routes each `OutputDelta` to the stream of the request it belongs to, and an `EngineFailed`
to the streams of the requests the engine lost (as `Failed`); the `LLM` handle reads the streams.
"""

from __future__ import annotations

from typing import Any

from sonar.actors import Actor
from sonar.protocol.engine import EngineFailed, FrontendMsg, Outputs


class Failed:
    """On a request's stream: the engine cannot finish it (`reason` says why)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class ClientActor(Actor):
    """Receives `Outputs` and routes each delta to the stream of the request it belongs to."""

    protocol = FrontendMsg

    def __init__(self, streams: dict[str, Any]) -> None:
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
