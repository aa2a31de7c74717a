"""The per-process (per event loop) half of the runtime: mailboxes, pending asks, ZMQ sockets.

Every process that runs actors has one `Node`. Local delivery puts the message object straight
into the actor's bounded anyio memory stream (no serialization). Remote delivery encodes it with
the codec and sends it through a DEALER socket connected to the ROUTER socket of the node that
hosts the actor; the DEALER's routing id is this node's id, so replies come back over the same
connection. A node binds its ROUTER only when another process needs to reach it.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
import secrets
import socket
import tempfile
import weakref
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
import zmq

from sonar.actors.codec import Codec, resolve
from sonar.actors.transport import Channel
from sonar.actors.messages import (
    ActorError,
    ActorNotFound,
    RemoteError,
    ReplyTo,
)
from sonar.log import get_logger

log = get_logger("sonar.actors")


_nodes: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Node]" = weakref.WeakKeyDictionary()


def get_node() -> "Node":
    """The node of the running event loop, created on first use."""
    loop = asyncio.get_running_loop()
    node = _nodes.get(loop)
    if node is None:
        node = _nodes[loop] = Node()
    return node


class Hello(msgspec.Struct):
    """First frame a child process sends to its parent: who it is and where it listens."""

    key: str
    node: str
    address: str
    pid: int


class _ReplyToOnly(msgspec.Struct):
    reply_to: ReplyTo | None = None


@dataclass
class Mailbox:
    """An actor's bounded inbox; it outlives restarts of the actor that reads it."""

    name: str
    protocol: Any
    display: str
    decode_type: Any
    types: tuple[type, ...]
    send: Any
    receive: Any
    size: int

    def depth(self) -> int:
        return self.send.statistics().current_buffer_used


@dataclass
class _Pending:
    future: asyncio.Future
    reply_type: Any
    actor: str
    target: str | None = None  # the asked actor's mailbox name


class Node:
    def __init__(self) -> None:
        self.pid = os.getpid()
        self.short_id = f"{self.pid}-{secrets.token_hex(3)}"
        self.node_id = f"{socket.gethostname()}-{self.short_id}"
        self.address: str | None = None
        self.codec = Codec(make_ref=self._make_ref)
        self.mailboxes: dict[str, Mailbox] = {}
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._ctx: zmq.Context | None = None
        self._router: Channel | None = None
        self._dealers: dict[str, Channel] = {}
        self._tasks: set[asyncio.Task] = set()
        self._hellos: dict[str, asyncio.Future] = {}
        self._ipc_path: str | None = None
        # Messages queued per ZMQ connection (each way) before a sender waits.
        self.hwm = int(os.environ.get("SONAR_ACTOR_HWM", "1000"))
        self.users = 0  # open supervision trees; the last one to end closes the sockets
        self._loose = msgspec.msgpack.Decoder(_ReplyToOnly, ext_hook=lambda code, data: None)

    # -- mailboxes --------------------------------------------------------------------------
    def mailbox(self, name: str, protocol: Any, size: int, display: str | None = None) -> Mailbox:
        """The mailbox named `name`, created on first use (a restarted actor gets the same one)."""
        mb = self.mailboxes.get(name)
        if mb is None:
            from sonar.actors.ref import protocol_types
            from sonar.actors.messages import SYSTEM_MESSAGES

            types = protocol_types(protocol)
            send, receive = anyio.create_memory_object_stream[Any](max_buffer_size=size)
            decode_type = _union(*types, *SYSTEM_MESSAGES)
            mb = self.mailboxes[name] = Mailbox(name, protocol, display or name, decode_type, types + SYSTEM_MESSAGES,
                                                send, receive, size)
        return mb

    def remove_mailbox(self, name: str) -> None:
        mb = self.mailboxes.pop(name, None)
        if mb is not None:
            mb.send.close()
            mb.receive.close()

    def is_local(self, address: str | None) -> bool:
        return address is None or address == self.address

    # -- delivery ---------------------------------------------------------------------------
    async def deliver(self, name: str, address: str | None, msg: Any) -> None:
        if self.is_local(address):
            mb = self.mailboxes.get(name)
            if mb is None:
                raise ActorNotFound(f"no actor named {name!r} in this process")
            if not isinstance(msg, mb.types):
                raise TypeError(f"actor {name!r} does not accept {type(msg).__qualname__}")
            try:
                try:
                    mb.send.send_nowait(msg)  # the common case, without a trip round the loop
                except anyio.WouldBlock:
                    await mb.send.send(msg)
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                raise ActorNotFound(f"actor {name!r} has stopped") from None
            return
        frames = [b"M", name.encode(), *self.codec.encode(msg)]
        await self._send_dealer(address, frames)

    def new_ask(self, reply_type: Any, actor: str, target: str | None = None) -> tuple[ReplyTo, asyncio.Future]:
        ask_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[ask_id] = _Pending(fut, reply_type, actor, target)
        return ReplyTo(self.node_id, ask_id, self.address), fut

    def fail_asks(self, target: str, reason: str) -> int:
        """Fail this process's asks still waiting on the actor `target` (a mailbox name): its run
        ended, so no answer will come. A supervisor calls it when a child's run ends, so an asker
        in the supervisor's process learns of a dead child at once instead of at its timeout."""
        failed = 0
        for ask_id, pending in list(self._pending.items()):
            if pending.target == target and not pending.future.done():
                error = RemoteError(type="ActorExited", message=reason, traceback="")
                self._resolve_local(ask_id, None, error)
                failed += 1
        return failed

    def forget_ask(self, ask_id: int) -> None:
        self._pending.pop(ask_id, None)

    async def reply(self, to: ReplyTo, value: Any = None, error: RemoteError | None = None) -> None:
        """Send a reply (or an error) to the asker, wherever it lives."""
        if to.node == self.node_id:
            self._resolve_local(to.id, value, error)
            return
        head = [b"R", to.id.to_bytes(8, "little")]
        frames = head + ([b"err", msgspec.msgpack.encode(error)] if error else [b"ok", *self.codec.encode(value)])
        if self._router is not None:
            try:
                await self._router.send([to.node.encode(), *frames])
                return
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
        if to.address is None:
            log.warning("actor.reply_lost", to=to.node, reason="asker unreachable")
            return
        await self._send_dealer(to.address, frames)

    def _resolve_local(self, ask_id: int, value: Any, error: RemoteError | None) -> None:
        pending = self._pending.pop(ask_id, None)
        if pending is None or pending.future.done():
            return  # the asker gave up (timeout or cancel) before the reply came
        if error is not None:
            pending.future.set_exception(ActorError(error, pending.actor))
        else:
            pending.future.set_result(value)

    def _resolve_remote(self, frames: list[Any]) -> None:
        ask_id = int.from_bytes(frames[0].bytes, "little")
        pending = self._pending.get(ask_id)
        if pending is None or pending.future.done():
            self._pending.pop(ask_id, None)
            return
        status = frames[1].bytes
        try:
            if status == b"err":
                error = msgspec.msgpack.decode(frames[2].bytes, type=RemoteError)
                self._resolve_local(ask_id, None, error)
            else:
                self._resolve_local(ask_id, self.codec.decode(frames[2:], pending.reply_type), None)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            self._resolve_local(ask_id, None, RemoteError.from_exception(exc))

    # -- ZMQ --------------------------------------------------------------------------------
    def _context(self) -> zmq.Context:
        if self._ctx is None:
            self._ctx = zmq.Context()
        return self._ctx

    def ensure_bound(self, address: str | None = None) -> str:
        """Bind this node's ROUTER (default: a private ipc path) and start reading from it."""
        if self._router is not None:
            return self.address  # type: ignore[return-value]
        if address is None:
            address = self.ipc_address("node")
        if address.startswith("ipc://"):
            self._ipc_path = address.removeprefix("ipc://")
            try:
                os.unlink(self._ipc_path)
            except FileNotFoundError:
                pass
        sock = self._context().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, self.hwm)
        sock.setsockopt(zmq.RCVHWM, self.hwm)
        sock.bind(address)
        if address.startswith("tcp://") and address.endswith(":0"):
            address = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.address = address
        self._router = Channel(sock, self._on_router)
        return address

    def ipc_address(self, name: str) -> str:
        """A private ipc address for `name` under this node (short: unix paths max out at 107)."""
        if len(name) > 40 or not name.replace("_", "").replace("-", "").replace(".", "").isalnum():
            name = hashlib.sha1(name.encode()).hexdigest()[:16]
        return f"ipc://{tempfile.gettempdir()}/sonar-{self.short_id}-{name}.sock"

    def _dealer(self, address: str) -> Channel:
        dealer = self._dealers.get(address)
        if dealer is None:
            sock = self._context().socket(zmq.DEALER)
            sock.setsockopt(zmq.ROUTING_ID, self.node_id.encode())
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, self.hwm)
            sock.setsockopt(zmq.RCVHWM, self.hwm)
            sock.connect(address)
            dealer = self._dealers[address] = Channel(sock, self._on_dealer)
        return dealer

    async def _send_dealer(self, address: str, frames: list[Any]) -> None:
        await self._dealer(address).send(frames)

    def _on_dealer(self, frames: list[Any]) -> None:
        if frames[0].bytes == b"R":
            self._resolve_remote(frames[1:])

    def _on_router(self, frames: list[Any]) -> bool | None:
        kind = frames[1].bytes
        try:
            if kind == b"M":
                return self._incoming(frames[2].bytes.decode(), frames[3:])
            if kind == b"R":
                self._resolve_remote(frames[2:])
            elif kind == b"H":
                hello = msgspec.msgpack.decode(frames[2].bytes, type=Hello)
                fut = self._hellos.get(hello.key)
                if fut is not None and not fut.done():
                    fut.set_result(hello)
        except Exception as exc:  # a bad frame must not stop the node from reading
            log.error("actor.bad_frame", kind=kind, error=repr(exc))
        return None

    def _incoming(self, name: str, frames: list[Any]) -> bool | None:
        """Put a received message into its mailbox; returns False to pause reading when it is full."""
        mb = self.mailboxes.get(name)
        if mb is None:
            self._spawn(self._refuse(frames, ActorNotFound(f"no actor named {name!r} at {self.address}"), name))
            return None
        try:
            msg = self.codec.decode(frames, mb.decode_type)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as exc:
            log.error("actor.bad_message", actor=name, error=str(exc))
            self._spawn(self._refuse(frames, TypeError(f"message for {name!r} failed to decode: {exc}"), name))
            return None
        try:
            mb.send.send_nowait(msg)
            return None
        except anyio.WouldBlock:
            self._spawn(self._deliver_later(mb, msg, frames))
            return False  # backpressure: stop reading until the actor catches up
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._spawn(self._refuse(frames, ActorNotFound(f"actor {name!r} has stopped"), name))
            return None

    async def _deliver_later(self, mb: Mailbox, msg: Any, frames: list[Any]) -> None:
        try:
            await mb.send.send(msg)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            await self._refuse(frames, ActorNotFound(f"actor {mb.name!r} has stopped"), mb.name)
        finally:
            if self._router is not None:
                self._router.resume()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _refuse(self, frames: list[Any], exc: Exception, name: str) -> None:
        """Answer a message that cannot be delivered with an error, when it expects an answer."""
        try:
            reply_to = self._loose.decode(frames[0].buffer).reply_to
        except (msgspec.DecodeError, msgspec.ValidationError):
            reply_to = None
        if reply_to is None:
            log.warning("actor.message_dropped", actor=name, reason=str(exc))
            return
        await self.reply(reply_to, error=RemoteError.from_exception(exc))

    # -- child handshake ----------------------------------------------------------------------
    def expect_hello(self, key: str) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self._hellos[key] = fut
        fut.add_done_callback(lambda _: self._hellos.pop(key, None))
        return fut

    async def say_hello(self, parent: str, key: str) -> None:
        assert self.address is not None
        hello = Hello(key=key, node=self.node_id, address=self.address, pid=self.pid)
        await self._send_dealer(parent, [b"H", msgspec.msgpack.encode(hello)])

    def _make_ref(self, name: str, address: str | None, protocol: str) -> Any:
        from sonar.actors.ref import ActorRef

        if address == self.address:
            address = None
        return ActorRef(name, resolve(protocol), address)

    def close(self, linger_ms: int = 0) -> None:
        """Close every socket (the node can be used again afterwards).

        `linger_ms` lets queued outgoing messages (a last reply) leave before the sockets go.
        """
        for task in self._tasks:
            task.cancel()
        for dealer in self._dealers.values():
            dealer.close(linger_ms)
        if self._router is not None:
            self._router.close(linger_ms)
        if self._ipc_path:
            try:
                os.unlink(self._ipc_path)
            except FileNotFoundError:
                pass
        self._dealers.clear()
        self._router = None
        self.address = None
        self._ipc_path = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None


def _union(*types: Any) -> Any:
    from typing import Union

    return Union[types]  # type: ignore[valid-type]
