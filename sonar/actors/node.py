"""The per-process (per event loop) half of the runtime: mailboxes, pending asks, ZMQ sockets.

Every process that runs actors has one `Node`. Local delivery puts the message object straight
into the actor's bounded anyio memory stream (no serialization). Remote delivery encodes it with
the codec and sends it through a DEALER socket connected to the ROUTER socket of the node that
hosts the actor; the DEALER's routing id is this node's id, so replies come back over the same
connection. A node binds its ROUTER only when another process needs to reach it.

Every link is authenticated (`sonar.actors.keys`: CURVE, or PLAIN on a private ipc link): the
node's own ZAP handler accepts a connection only from an allowed client key, before any message
of it is read. Frames are capped in size (`SONAR_ACTOR_MAX_FRAME_BYTES`). A reply is taken only
from the peer that was asked, under an unguessable ask id. `Stop` from a peer reaches an actor
only when that peer's key spawned it.

Backpressure is per mailbox: a message for a full mailbox waits in that mailbox's overflow queue
and its sender is told to hold (`hold`) until the queue is down to half the mailbox's size
(`go`); the node keeps reading its socket, so the other actors it hosts keep receiving. A sender holds sends to that one
mailbox only, and probes again after `HOLD_PROBE` seconds without a `go` (the receiver may have
been restarted meanwhile). Only when the overflow queues together pass four times the ZMQ
high-water mark (a sender that ignores `hold`, or a flood of small messages already in flight
when `hold` went out) does the node stop reading until they drain, as a last resort.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import secrets
import shutil
import socket
import stat
import tempfile
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import anyio
import msgspec
import zmq
import zmq.utils.z85

from sonar.actors import keys
from sonar.actors.allow import load_protocol
from sonar.actors.codec import Codec
from sonar.actors.messages import (
    SYSTEM_MESSAGES,
    ActorError,
    ActorNotFound,
    RemoteError,
    ReplyTo,
    Stop,
    protocol_types,
)
from sonar.actors.transport import Channel
from sonar.errors import SonarError
from sonar.log import get_logger

log = get_logger("sonar.actors")

MAX_FRAME_ENV = "SONAR_ACTOR_MAX_FRAME_BYTES"
DEFAULT_MAX_FRAME_BYTES = 4 * 2**30
"""The largest frame a node sends or accepts. The largest legitimate one is a KV offload `Load`
reply (a sequence's whole cached prefix: max model length × KV bytes per token) when the
offload manager and the worker run in different processes; raise it for longer contexts of
larger models."""

HOLD_PROBE = 1.0
"""Seconds a sender told to hold waits for `go` before it sends again (and is told to hold again
if the mailbox is still full)."""
AWAITED_LIMIT = 1024
"""Messages held for one mailbox that does not exist yet (`ActorNode.await_mailbox`)."""

HOLD, GO = b"hold", b"go"


class FrameTooLarge(SonarError, ValueError):
    """A message frame over the node's frame cap (`SONAR_ACTOR_MAX_FRAME_BYTES`)."""


_max_frame_bytes: int | None = None


def configure_transport(keys_dir: "str | os.PathLike[str] | None" = None, max_frame_bytes: int | None = None) -> None:
    """Process-wide transport settings, before the first actor socket opens: the deployment's
    keys directory (None: `SONAR_ACTOR_KEYS`, else ephemeral keys) and the frame cap (None:
    `SONAR_ACTOR_MAX_FRAME_BYTES`, else 4 GiB). Child processes get both from their parent."""
    global _max_frame_bytes
    if max_frame_bytes is not None and max_frame_bytes <= 0:
        raise ValueError(f"the actor frame cap must be positive, got {max_frame_bytes}")
    keys.configure(keys_dir)
    _max_frame_bytes = max_frame_bytes


def max_frame_bytes() -> int:
    if _max_frame_bytes is not None:
        return _max_frame_bytes
    raw = os.environ.get(MAX_FRAME_ENV)
    if not raw:
        return DEFAULT_MAX_FRAME_BYTES
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{MAX_FRAME_ENV}: expected a number of bytes, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{MAX_FRAME_ENV} must be positive, got {value}")
    return value


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

    owner: str | None = None
    """Client key (z85) of the peer that spawned the actor: the only one whose `Stop` it takes."""
    guard: Callable[[Any, str | None], str | None] | None = None
    """Checks each message from a peer (and the peer's key): a reason to refuse it, or None."""
    overflow: deque = field(default_factory=deque)
    """Messages from peers that found the mailbox full, in arrival order: (message, peer, frames)."""
    held: dict[bytes, float] = field(default_factory=dict)
    """Peers told to hold, with when they were last told."""
    draining: bool = False

    def depth(self) -> int:
        return self.send.statistics().current_buffer_used + len(self.overflow)


@dataclass
class _Pending:
    future: asyncio.Future
    reply_type: Any
    actor: str
    target: str | None = None  # the asked actor's mailbox name
    peer: str | None = None  # the address the ask went to (None: this process)


class Node:
    make_ref: Callable[[str, Any, str | None], Any]
    """How a ref that arrives on the wire becomes an `ActorRef` (set by `sonar.actors.ref`, which
    sits above the node)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.short_id = f"{self.pid}-{secrets.token_hex(3)}"
        self.node_id = f"{socket.gethostname()}-{self.short_id}"
        self.address: str | None = None
        self.codec = Codec(make_ref=self._make_ref)
        self.mailboxes: dict[str, Mailbox] = {}
        self._pending: dict[int, _Pending] = {}
        self._ctx: zmq.Context | None = None
        self._creds: keys.Credentials | None = None
        self._zap: Channel | None = None
        self._refused: set[tuple[bytes, bytes]] = set()  # (peer address, key) logged already
        self._router: Channel | None = None
        self._dealers: dict[str, Channel] = {}
        self._tasks: set[asyncio.Task] = set()
        self._hellos: dict[str, asyncio.Future] = {}
        self._peer_address: dict[bytes, str] = {}  # a child's routing id -> its address (from its hello)
        self._held: dict[tuple[str, str], asyncio.Event] = {}  # (address, mailbox) told to hold
        self._overflowing = 0  # messages in all mailboxes' overflow queues
        self._awaited: dict[str, list[tuple[bytes, list[Any]]]] = {}  # see `await_mailbox`
        self._router_paused = False
        self._ipc_path: str | None = None
        self._ipc_dir: str | None = None
        # Messages queued per ZMQ connection (each way) before a sender waits.
        self.hwm = int(os.environ.get("SONAR_ACTOR_HWM", "1000"))
        self.max_frame_bytes = max_frame_bytes()
        self.users = 0  # open supervision trees; the last one to end closes the sockets
        self._loose = msgspec.msgpack.Decoder(_ReplyToOnly, ext_hook=lambda code, data: None)

    # -- mailboxes --------------------------------------------------------------------------
    def mailbox(self, name: str, protocol: Any, size: int, display: str | None = None) -> Mailbox:
        """The mailbox named `name`, created on first use (a restarted actor gets the same one)."""
        mb = self.mailboxes.get(name)
        if mb is None:
            types = protocol_types(protocol)
            send, receive = anyio.create_memory_object_stream[Any](max_buffer_size=size)
            decode_type = _union(*types, *SYSTEM_MESSAGES)
            mb = self.mailboxes[name] = Mailbox(
                name, protocol, display or name, decode_type, types + SYSTEM_MESSAGES, send, receive, size
            )
            for peer, frames in self._awaited.pop(name, ()):
                self._incoming(peer, name, frames)
        return mb

    def await_mailbox(self, name: str) -> None:
        """Hold messages for `name` that arrive before its mailbox exists, and deliver them when it
        does (a child host between its bind and the spawn of its one actor: a sibling started at the
        same time may already be sending to it). At most `AWAITED_LIMIT` are held; more are refused."""
        if name not in self.mailboxes:
            self._awaited.setdefault(name, [])

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
        frames = [b"M", name.encode(), *self._encode(msg)]
        if self._held:
            held = self._held.get((address, name))  # type: ignore[arg-type]
            if held is not None:
                await self._wait_go((address, name), held)  # type: ignore[arg-type]
        await self._send_dealer(address, frames)

    async def _wait_go(self, key: tuple[str, str], held: asyncio.Event) -> None:
        with anyio.move_on_after(HOLD_PROBE):
            await held.wait()
        if self._held.get(key) is held:
            del self._held[key]

    def _encode(self, value: Any) -> list[Any]:
        frames = self.codec.encode(value)
        cap = self.max_frame_bytes
        for frame in frames:
            size = frame.nbytes if hasattr(frame, "nbytes") else len(frame)
            if size > cap:
                raise FrameTooLarge(
                    f"a frame of {size} bytes is over the actor transport's cap of {cap} bytes "
                    f"({MAX_FRAME_ENV}, sonar serve --actor-max-frame-bytes)"
                )
        return frames

    def new_ask(
        self, reply_type: Any, actor: str, target: str | None = None, address: str | None = None
    ) -> tuple[ReplyTo, asyncio.Future]:
        ask_id = secrets.randbits(63)  # unguessable: a peer cannot answer an ask it was not sent
        while ask_id in self._pending:
            ask_id = secrets.randbits(63)
        fut = asyncio.get_running_loop().create_future()
        peer = None if self.is_local(address) else address
        self._pending[ask_id] = _Pending(fut, reply_type, actor, target, peer)
        return ReplyTo(self.node_id, ask_id, self.address), fut

    def fail_asks(self, target: str, reason: str, peer: str | None = None) -> int:
        """Fail this process's asks still waiting on the actor `target` (a mailbox name; with
        `peer`, the one at that address): its run ended, so no answer will come. A supervisor
        calls it when a child's run ends, so an asker in the supervisor's process learns of a
        dead child at once instead of at its timeout."""
        failed = 0
        for ask_id, pending in list(self._pending.items()):
            if pending.target == target and peer in (None, pending.peer) and not pending.future.done():
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
        if error is None:
            try:
                frames = head + [b"ok", *self._encode(value)]
            except FrameTooLarge as exc:
                error = RemoteError.from_exception(exc)
        if error is not None:
            frames = head + [b"err", msgspec.msgpack.encode(error)]
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

    def _resolve_remote(self, peer: str | None, frames: list[Any]) -> None:
        """A reply from `peer` (the address it came from; None: unknown): taken only when that
        is where the ask went."""
        ask_id = int.from_bytes(frames[0].bytes, "little")
        pending = self._pending.get(ask_id)
        if pending is None or pending.future.done():
            self._pending.pop(ask_id, None)
            return
        if peer is None or peer != pending.peer:
            log.warning(
                "actor.reply_refused",
                actor=pending.actor,
                expected=pending.peer,
                peer=peer,
                reason="the reply came from another peer than the one asked",
            )
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
        """The ZMQ context, with this node's ZAP handler bound before any socket can accept."""
        if self._ctx is None:
            self._creds = keys.current()
            self._ctx = zmq.Context()
            zap = self._ctx.socket(zmq.REP)
            zap.setsockopt(zmq.LINGER, 0)
            zap.bind("inproc://zeromq.zap.01")
            self._zap = Channel(zap, self._on_zap)
        return self._ctx

    @property
    def credentials(self) -> keys.Credentials:
        self._context()
        assert self._creds is not None
        return self._creds

    def _on_zap(self, frames: list[Any]) -> None:
        """Answer one ZAP request: a connecting peer is let in only with an allowed client key
        (and, on a private ipc link, the link password)."""
        request = [f.bytes for f in frames]
        request_id = request[1] if len(request) > 1 else b""
        mechanism = request[5] if len(request) > 5 else b""
        creds = self._creds
        key, allowed = b"", False
        if creds is not None and mechanism == b"CURVE" and len(request) == 7 and len(request[6]) == 32:
            key = zmq.utils.z85.encode(request[6])
            allowed = creds.accepts(key)
        elif creds is not None and mechanism == b"PLAIN" and len(request) == 8:  # a private ipc link
            key = request[6]
            allowed = hmac.compare_digest(request[7], creds.link_password) and creds.accepts(key)
        peer = request[3] if len(request) > 3 else b"?"
        if not allowed and (peer, key) not in self._refused:
            if len(self._refused) < 1024:  # one line per stranger, not one per reconnect
                self._refused.add((peer, key))
            log.warning(
                "actor.peer_refused",
                peer=peer.decode(errors="replace"),
                mechanism=mechanism.decode(errors="replace"),
                key=key.decode(),
                reason="client key (or private link password) not accepted",
            )
        reply = [
            b"1.0",
            request_id,
            b"200" if allowed else b"400",
            b"OK" if allowed else b"not allowed",
            key if allowed else b"",
            b"",
        ]
        assert self._zap is not None
        self._zap.send_nowait(reply)

    def _socket(self, kind: int, address: str, server: bool) -> zmq.Socket:
        """A ROUTER bound to (server) or a DEALER connected to `address`, authenticated both ways
        (`_secure`), with this node's queue bounds; closed again if any of that fails."""
        sock = self._context().socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.hwm)
        sock.setsockopt(zmq.RCVHWM, self.hwm)
        if server:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        else:
            sock.setsockopt(zmq.ROUTING_ID, self.node_id.encode())
        try:
            self._secure(sock, address, server=server)
            if server:
                sock.bind(address)
            else:
                sock.connect(address)
        except BaseException:
            sock.close(linger=0)
            raise
        return sock

    def _secure(self, sock: zmq.Socket, address: str, server: bool) -> None:
        """CURVE, or PLAIN checked by the same ZAP handler on a private ipc link (`keys`)."""
        creds = self.credentials
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        if server:
            sock.setsockopt(zmq.ZAP_DOMAIN, b"sonar")
        if _private_ipc(address):
            if server:
                sock.setsockopt(zmq.PLAIN_SERVER, 1)
            else:
                sock.setsockopt(zmq.PLAIN_USERNAME, creds.client_public)
                sock.setsockopt(zmq.PLAIN_PASSWORD, creds.link_password)
        elif server:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, creds.server_secret)
        else:
            sock.setsockopt(zmq.CURVE_SERVERKEY, creds.server_public)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, creds.client_public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, creds.client_secret)

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
        sock = self._socket(zmq.ROUTER, address, server=True)
        if self._ipc_path:
            os.chmod(self._ipc_path, 0o600)
        if address.startswith("tcp://") and address.endswith(":0"):
            address = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.address = address
        self._router = Channel(sock, self._on_router)
        return address

    def ipc_address(self, name: str) -> str:
        """A private ipc address for `name` under this node: in a directory of this node's only
        its user can enter (0700), short (unix paths max out at 107 bytes)."""
        if len(name) > 40 or not name.replace("_", "").replace("-", "").replace(".", "").isalnum():
            name = hashlib.sha1(name.encode()).hexdigest()[:16]
        if self._ipc_dir is None:
            self._ipc_dir = tempfile.mkdtemp(prefix=f"sonar-{self.short_id}-")  # mode 0700
        return f"ipc://{self._ipc_dir}/{name}.sock"

    def _dealer(self, address: str) -> Channel:
        dealer = self._dealers.get(address)
        if dealer is None:
            sock = self._socket(zmq.DEALER, address, server=False)
            dealer = self._dealers[address] = Channel(sock, lambda frames: self._on_dealer(address, frames))
        return dealer

    async def _send_dealer(self, address: str, frames: list[Any]) -> None:
        await self._dealer(address).send(frames)

    def _on_dealer(self, address: str, frames: list[Any]) -> None:
        kind = frames[0].bytes
        try:
            if kind == b"R":
                self._resolve_remote(address, frames[1:])
            elif kind == HOLD:
                self._held.setdefault((address, frames[1].bytes.decode()), asyncio.Event())
            elif kind == GO:
                held = self._held.pop((address, frames[1].bytes.decode()), None)
                if held is not None:
                    held.set()
        except Exception as exc:  # a bad frame must not stop the node from reading
            log.error("actor.bad_frame", kind=kind, error=repr(exc))

    def _on_router(self, frames: list[Any]) -> bool | None:
        peer = frames[0].bytes
        kind = frames[1].bytes
        try:
            if kind == b"M":
                return self._incoming(peer, frames[2].bytes.decode(), frames[3:])
            if kind == b"R":
                self._resolve_remote(self._peer_address.get(peer), frames[2:])
            elif kind == b"H":
                hello = msgspec.msgpack.decode(frames[2].bytes, type=Hello)
                fut = self._hellos.get(hello.key)
                if fut is not None and not fut.done():
                    self._peer_address[peer] = hello.address
                    fut.set_result(hello)
        except Exception as exc:  # a bad frame must not stop the node from reading
            log.error("actor.bad_frame", kind=kind, error=repr(exc))
        return None

    def _incoming(self, peer: bytes, name: str, frames: list[Any]) -> bool | None:
        """Put a message from `peer` into its mailbox, or into the mailbox's overflow queue when
        it is full (the sender is then told to hold); returns False to stop reading the socket
        (only when the overflow queues are past their bound)."""
        mb = self.mailboxes.get(name)
        if mb is None:
            awaited = self._awaited.get(name)
            if awaited is not None and len(awaited) < AWAITED_LIMIT:
                awaited.append((peer, frames))
                return None
            self._spawn(self._refuse(frames, ActorNotFound(f"no actor named {name!r} at {self.address}"), name))
            return None
        try:
            msg = self.codec.decode(frames, mb.decode_type)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as exc:
            log.error("actor.bad_message", actor=name, error=str(exc))
            self._spawn(self._refuse(frames, TypeError(f"message for {name!r} failed to decode: {exc}"), name))
            return None
        if mb.guard is not None or isinstance(msg, Stop):
            user = _user_id(frames[0])
            reason = self._admit(mb, msg, user)
            if reason is not None:
                log.warning(
                    "actor.message_refused", actor=name, message=type(msg).__qualname__, peer=user, reason=reason
                )
                self._spawn(self._refuse(frames, PermissionError(reason), name, quiet=True))
                return None
        if not mb.overflow:
            try:
                mb.send.send_nowait(msg)
                return None
            except anyio.WouldBlock:
                pass
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                self._spawn(self._refuse(frames, ActorNotFound(f"actor {name!r} has stopped"), name))
                return None
        return self._overflow(mb, msg, peer, frames)

    @staticmethod
    def _admit(mb: Mailbox, msg: Any, user: str | None) -> str | None:
        if isinstance(msg, Stop) and (mb.owner is None or mb.owner != user):
            return "only the supervisor that spawned an actor may stop it"
        return mb.guard(msg, user) if mb.guard is not None else None

    def _overflow(self, mb: Mailbox, msg: Any, peer: bytes, frames: list[Any]) -> bool | None:
        mb.overflow.append((msg, peer, frames))
        self._overflowing += 1
        now = time.monotonic()
        if now - mb.held.get(peer, -HOLD_PROBE) >= HOLD_PROBE / 2:
            mb.held[peer] = now
            self._signal(peer, HOLD, mb.name)
        if not mb.draining:
            mb.draining = True
            self._spawn(self._drain(mb))
        if self._overflowing > 4 * self.hwm:
            if not self._router_paused:
                log.warning(
                    "actor.overflow_full",
                    actor=mb.name,
                    queued=self._overflowing,
                    reason="overflow queues past 4 x SONAR_ACTOR_HWM messages: reading paused until they drain",
                )
            self._router_paused = True
            return False
        return None

    async def _drain(self, mb: Mailbox) -> None:
        """Move a mailbox's overflow queue into it as the actor makes room; its senders may go
        on once it is down to half the mailbox's size (so the pipeline never runs dry)."""
        low = mb.size // 2
        try:
            while mb.overflow:
                msg, _, frames = mb.overflow[0]
                try:
                    try:
                        mb.send.send_nowait(msg)  # no trip round the loop while the mailbox has room
                    except anyio.WouldBlock:
                        await mb.send.send(msg)
                except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                    stopped = ActorNotFound(f"actor {mb.name!r} has stopped")
                    while mb.overflow:
                        _, _, frames = mb.overflow.popleft()
                        self._overflowing -= 1
                        await self._refuse(frames, stopped, mb.name)
                    break
                mb.overflow.popleft()
                self._overflowing -= 1
                if mb.held and len(mb.overflow) <= low:
                    self._release(mb)
        finally:
            mb.draining = False
            self._release(mb)

    def _release(self, mb: Mailbox) -> None:
        for peer in mb.held:
            self._signal(peer, GO, mb.name)
        mb.held.clear()
        if self._router_paused and self._overflowing <= 4 * self.hwm and self._router is not None:
            self._router_paused = False
            self._router.resume()

    def _signal(self, peer: bytes, kind: bytes, name: str) -> None:
        """Send a flow-control frame to a connected peer; best effort (a lost `go` costs the
        sender at most `HOLD_PROBE` seconds)."""
        if self._router is not None:
            self._router.send_nowait([peer, kind, name.encode()])

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _refuse(self, frames: list[Any], exc: Exception, name: str, quiet: bool = False) -> None:
        """Answer a message that cannot be delivered with an error, when it expects an answer."""
        try:
            reply_to = self._loose.decode(frames[0].buffer).reply_to
        except (msgspec.DecodeError, msgspec.ValidationError):
            reply_to = None
        if reply_to is None:
            if not quiet:
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
        if address == self.address:
            address = None
        return Node.make_ref(name, load_protocol(protocol), address)

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
        if self._zap is not None:
            self._zap.close()
        if self._ipc_path:
            try:
                os.unlink(self._ipc_path)
            except FileNotFoundError:
                pass
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
        self._dealers.clear()
        self._held.clear()
        self._peer_address.clear()
        self._router = None
        self._zap = None
        self.address = None
        self._ipc_path = None
        self._ipc_dir = None
        self._router_paused = False
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
            self._creds = None


def _private_ipc(address: str) -> bool:
    """True for an ipc address in a node's private socket directory (`Node.ipc_address`): one of
    this user's, that only this user can enter."""
    if not address.startswith("ipc://"):
        return False
    directory = os.path.dirname(address.removeprefix("ipc://"))
    try:
        st = os.stat(directory)
    except OSError:
        return False
    return (
        os.path.basename(directory).startswith("sonar-")
        and st.st_uid == os.getuid()
        and stat.S_IMODE(st.st_mode) == 0o700
    )


def _user_id(frame: Any) -> str | None:
    """The client key (z85) the ZAP handler admitted the frame's sender with."""
    try:
        return frame.get("User-Id")
    except (zmq.ZMQError, AttributeError):
        return None


def _union(*types: Any) -> Any:
    from typing import Union

    return Union[types]  # type: ignore[valid-type]
