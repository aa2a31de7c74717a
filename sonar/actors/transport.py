"""ZMQ sockets driven straight from the asyncio loop.

pyzmq's own asyncio sockets create a future per receive and per send; on a 2-core machine that
bookkeeping cost more than the ZMQ hop itself. A `Channel` instead registers the socket's file
descriptor with the loop and drains every ready message in one callback. ZMQ's descriptor is
edge-triggered: after any send or receive the socket's EVENTS must be read again, so every
operation schedules one more look.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, Callable

import zmq

# Return False from `on_message` to stop reading until `resume()` (backpressure).
OnMessage = Callable[[list[Any]], "bool | None"]


class Channel:
    def __init__(self, sock: zmq.Socket, on_message: OnMessage) -> None:
        self.sock = sock
        self.on_message = on_message
        self.loop = asyncio.get_running_loop()
        self.fd = sock.getsockopt(zmq.FD)
        self._writers: deque[asyncio.Future] = deque()
        self._paused = False
        self._closed = False
        self._scheduled = False
        self.loop.add_reader(self.fd, self._on_event)
        self._look_again()

    def _look_again(self) -> None:
        if not self._scheduled and not self._closed:
            self._scheduled = True
            self.loop.call_soon(self._on_event)

    def _on_event(self) -> None:
        self._scheduled = False
        if self._closed:
            return
        events = self.sock.getsockopt(zmq.EVENTS)
        if events & zmq.POLLOUT:
            while self._writers:
                fut = self._writers.popleft()
                if not fut.done():
                    fut.set_result(None)
        while events & zmq.POLLIN and not self._paused:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            if self.on_message(frames) is False:
                self._paused = True
            if self._closed:
                return
            events = self.sock.getsockopt(zmq.EVENTS)

    def resume(self) -> None:
        self._paused = False
        self._look_again()

    def send_nowait(self, frames: list[Any]) -> bool:
        """Send now or not at all (False: the queue is full, or the peer is gone)."""
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False
        finally:
            self._look_again()

    async def send(self, frames: list[Any]) -> None:
        """Queue a multipart message; waits (never drops) while the socket is at its high-water mark."""
        while True:
            try:
                self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
                break
            except zmq.Again:
                fut = self.loop.create_future()
                self._writers.append(fut)
                self._look_again()
                try:
                    # The wake-up comes from _on_event; the timeout is a safety net for an edge
                    # that fell between two looks.
                    await asyncio.wait_for(fut, 0.01)
                except asyncio.TimeoutError:
                    pass
        self._look_again()

    def close(self, linger_ms: int = 0) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.loop.remove_reader(self.fd)
        except (RuntimeError, ValueError):  # the loop is already closed
            pass
        for fut in self._writers:
            if not fut.done():
                fut.cancel()
        self.sock.close(linger=linger_ms)
