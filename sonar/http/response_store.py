"""The in-memory store of responses: what `previous_response_id` continues and
`GET /v1/responses/{id}` returns.

Bounded two ways (--max-stored-responses, --max-stored-response-bytes): putting a response in
evicts the oldest ones until both bounds hold again, so memory stays bounded whatever clients send.
A response bigger than the byte bound alone is not kept. Each entry holds the response object
as sent (JSON) and its whole conversation as chat-template messages (every earlier turn, this
input and this output; never the instructions, which OpenAI does not carry over), so a chain
continues even after its earlier links were evicted. The store is a plain value touched only from
the event loop: no locks, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec


@dataclass(frozen=True)
class StoredResponse:
    #: The response object as JSON, as it was answered.
    response: bytes
    #: The conversation up to and including this response's output, as chat-template messages.
    conversation: list[dict[str, Any]]
    #: Bytes counted against the store's bound.
    size: int


class ResponseStore:
    def __init__(self, max_responses: int, max_bytes: int) -> None:
        if max_responses < 0 or max_bytes < 0:
            raise ValueError("the store's bounds must be >= 0")
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._entries

    def put(self, response_id: str, response: bytes, conversation: list[dict[str, Any]]) -> list[str]:
        """Keep the response; returns the ids evicted to make room (the oldest first). A response
        that alone passes a bound is not kept (and evicts nothing)."""
        size = len(response) + len(msgspec.json.encode(conversation))
        self.delete(response_id)
        if size > self.max_bytes or self.max_responses == 0:
            return []
        evicted = []
        while self._entries and (len(self._entries) >= self.max_responses or self.bytes + size > self.max_bytes):
            old_id, old = self._entries.popitem(last=False)
            self.bytes -= old.size
            evicted.append(old_id)
        self._entries[response_id] = StoredResponse(response, conversation, size)
        self.bytes += size
        return evicted

    def get(self, response_id: str) -> StoredResponse | None:
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        old = self._entries.pop(response_id, None)
        if old is None:
            return False
        self.bytes -= old.size
        return True

    def check_invariants(self) -> None:
        assert len(self._entries) <= self.max_responses
        assert self.bytes == sum(e.size for e in self._entries.values()) <= self.max_bytes
