"""Scheduling policies: the order of the waiting queue and of the running list.

Both policies keep the running list sorted by the same key as the waiting queue, so the
running list is visited most-important first and its last entry is the preemption victim:

* ``fcfs``: by arrival at the scheduler; the victim is the newest running request.
* ``priority``: by ``(priority, arrival_time, arrival order)``, smaller first; the victim is
  the request with the largest priority value, the later arrival among equals.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterator
from typing import Literal, Protocol, get_args

from sonar.core.request import Request

__all__ = [
    "FcfsQueue",
    "POLICIES",
    "PriorityQueue",
    "SchedulingPolicy",
    "WaitingQueue",
    "make_waiting_queue",
    "policy_key",
]

SchedulingPolicy = Literal["fcfs", "priority"]
POLICIES: tuple[str, ...] = get_args(SchedulingPolicy)

SortKey = Callable[[Request], object]


def _fcfs_key(request: Request) -> int:
    return request.seq


def _priority_key(request: Request) -> tuple[int, float, int]:
    return (request.priority, request.arrival_time, request.seq)


def policy_key(policy: str) -> SortKey:
    """The sort key of ``policy``: smaller means scheduled earlier, preempted later."""
    if policy == "fcfs":
        return _fcfs_key
    if policy == "priority":
        return _priority_key
    raise ValueError(f"unknown scheduling policy {policy!r}; choose one of {', '.join(POLICIES)}")


class WaitingQueue(Protocol):
    def add(self, request: Request) -> None:
        """Queue a newly arrived request."""

    def add_preempted(self, request: Request) -> None:
        """Queue a preempted request ahead of the requests that arrived after it."""

    def peek(self) -> Request: ...

    def pop(self) -> Request: ...

    def remove(self, request: Request) -> None: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]: ...


class FcfsQueue:
    """Arrival order; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def add_preempted(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    """Sorted by ``policy_key('priority')``; a preempted request regains its place by key."""

    def __init__(self) -> None:
        self._items: list[Request] = []

    def add(self, request: Request) -> None:
        bisect.insort(self._items, request, key=_priority_key)

    add_preempted = add

    def peek(self) -> Request:
        return self._items[0]

    def pop(self) -> Request:
        return self._items.pop(0)

    def remove(self, request: Request) -> None:
        items = self._items
        index = bisect.bisect_left(items, _priority_key(request), key=_priority_key)
        while index < len(items) and items[index] is not request:
            index += 1
        if index == len(items):
            raise ValueError(f"{request!r} is not waiting")
        del items[index]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)


def make_waiting_queue(policy: str) -> WaitingQueue:
    policy_key(policy)
    return FcfsQueue() if policy == "fcfs" else PriorityQueue()
