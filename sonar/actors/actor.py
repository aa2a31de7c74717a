"""The actor base class and the loop that feeds it its mailbox, one message at a time."""

from __future__ import annotations

import os
from typing import Any, ClassVar

import anyio
import anyio.lowlevel
from anyio.abc import TaskGroup, TaskStatus

from sonar.actors.messages import ExitInfo, Ping, Pong, RemoteError, Stop
from sonar.actors.node import Mailbox, get_node
from sonar.actors.ref import ActorRef


class NoReply:
    """Returned by `handle` when the actor will answer later with `self.reply(...)`."""


NO_REPLY = NoReply()


class ActorExit(Exception):
    """Raised inside an actor (by `self.exit()`) to end it; `normal=False` counts as a crash."""

    def __init__(self, normal: bool = True, reason: str = "normal") -> None:
        super().__init__(reason)
        self.normal = normal
        self.reason = reason


class Actor:
    """Subclass it, set `protocol`, and implement `handle`.

    Lifecycle: `started()` runs before the actor is reported ready (its supervisor starts the next
    sibling only after that); `run()` is an optional body that runs beside the mailbox loop;
    `handle(msg)` gets each message in order and its return value is the reply to an ask;
    `stopping()` runs on a polite stop. An exception anywhere crashes the actor: its supervisor
    decides whether to restart it. Construction arguments must be plain data (msgspec-encodable)
    when the actor is placed in another process.
    """

    protocol: ClassVar[Any]

    name: str
    ref: ActorRef
    task_group: TaskGroup

    async def started(self) -> None:
        """Acquire resources; the actor counts as ready when this returns."""

    async def run(self) -> None:
        """Optional background body, run beside the mailbox loop; returning is fine."""

    async def handle(self, msg: Any) -> Any:
        raise NotImplementedError(f"{type(self).__qualname__} handles no messages")

    async def stopping(self) -> None:
        """Release resources on a polite stop (bounded by the child's shutdown deadline)."""

    def exit(self, normal: bool = True, reason: str = "normal") -> None:
        """End this actor from inside: normally (a `transient` child is then not restarted)."""
        raise ActorExit(normal, reason)

    async def reply(self, reply_to: Any, value: Any) -> None:
        """Answer an ask later (after `handle` returned `NO_REPLY`)."""
        await get_node().reply(reply_to, value)


async def serve(actor: Actor, mailbox: Mailbox, *, task_status: TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
    """Run `actor` on `mailbox` until it stops (returns) or crashes (raises)."""
    node = get_node()
    actor.name = mailbox.display
    actor.ref = ActorRef(mailbox.name, mailbox.protocol)
    receive = mailbox.receive
    try:
        async with anyio.create_task_group() as tg:
            actor.task_group = tg
            await actor.started()
            tg.start_soon(actor.run)
            task_status.started()
            handled = 0
            while True:
                try:
                    msg = receive.receive_nowait()
                    handled += 1
                    if handled % 64 == 0:  # a long queue must not starve the rest of the loop
                        await anyio.lowlevel.checkpoint()
                except anyio.WouldBlock:
                    try:
                        msg = await receive.receive()
                    except anyio.EndOfStream:
                        break
                except anyio.EndOfStream:
                    break
                if isinstance(msg, Ping):
                    if msg.reply_to is not None:
                        await node.reply(msg.reply_to, Pong(mailbox.depth(), os.getpid()))
                    continue
                if isinstance(msg, Stop):
                    break
                reply_to = getattr(msg, "reply_to", None)
                try:
                    result = await actor.handle(msg)
                except ActorExit:
                    if reply_to is not None:
                        await node.reply(reply_to, None)
                    raise
                except BaseException as exc:
                    if reply_to is not None and not isinstance(exc, anyio.get_cancelled_exc_class()):
                        with anyio.CancelScope(shield=True):
                            await node.reply(reply_to, error=RemoteError.from_exception(exc))
                    raise
                if reply_to is not None and result is not NO_REPLY:
                    await node.reply(reply_to, result)
            await actor.stopping()
            tg.cancel_scope.cancel()
    except ActorExit as exc:
        if not exc.normal:
            raise
    except BaseExceptionGroup as group:
        leaves = exception_leaves(group)
        exits = [e for e in leaves if isinstance(e, ActorExit)]
        others = [e for e in leaves if not isinstance(e, ActorExit)]
        if others:
            if len(others) == 1:
                raise others[0] from None
            raise
        if any(not e.normal for e in exits):
            raise exits[0] from None


def exception_leaves(group: BaseExceptionGroup) -> list[BaseException]:
    """The exceptions inside a (nested) exception group, depth first, in order."""
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(exception_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


class Incarnation:
    """One run of an actor on a fresh mailbox, with its ready/done events and how it ended."""

    def __init__(self, actor: Actor, mailbox: Mailbox) -> None:
        self.actor = actor
        self.mailbox = mailbox
        self.ready = anyio.Event()
        self.done = anyio.Event()
        self.start_error: BaseException | None = None
        self.exit: ExitInfo | None = None
        self._scope: anyio.CancelScope | None = None
        self._kill_reason: str | None = None

    @property
    def ref(self) -> ActorRef:
        """The way in to this run's actor, for code outside the runtime."""
        return self.actor.ref

    def kill(self, reason: str = "killed") -> None:
        """Cancel the actor where it is (it may be blocked in an await forever)."""
        self._kill_reason = reason
        if self._scope is not None:
            self._scope.cancel()

    async def run(self) -> None:
        status = _ReadyStatus(self.ready)
        try:
            with anyio.CancelScope() as scope:
                self._scope = scope
                if self._kill_reason is not None:
                    scope.cancel()
                await serve(self.actor, self.mailbox, task_status=status)
            if scope.cancelled_caught:
                self.exit = ExitInfo(False, self._kill_reason or "cancelled")
            else:
                self.exit = ExitInfo(True, "normal")
        except Exception as exc:
            if not status.was_started:
                self.start_error = exc
            error = RemoteError.from_exception(exc)
            reason = exc.reason if isinstance(exc, ActorExit) else "crash"
            self.exit = ExitInfo(False, reason, error)
        finally:
            get_node().remove_mailbox(self.mailbox.name)
            self.ready.set()
            self.done.set()


class _ReadyStatus:
    def __init__(self, event: anyio.Event) -> None:
        self.event = event
        self.was_started = False

    def started(self, value: Any = None) -> None:
        self.was_started = True
        self.event.set()


async def launch(tg: TaskGroup, actor: Actor, name: str, size: int, display: str | None = None) -> Incarnation:
    """Start `actor` in `tg` on a new mailbox named `name`; return once it is ready.

    `display` is the name the actor sees as `self.name` and logs use (default: `name`). Raises the
    actor's own exception when it fails before it is ready."""
    node = get_node()
    if name in node.mailboxes:
        raise RuntimeError(f"an actor named {name!r} is already running in this process")
    inc = Incarnation(actor, node.mailbox(name, type(actor).protocol, size, display))
    tg.start_soon(inc.run)
    await inc.ready.wait()
    if inc.start_error is not None:
        raise inc.start_error
    if inc.exit is not None and not inc.exit.normal:
        raise RuntimeError(f"actor {name!r} ended before it was ready: {inc.exit.reason}")
    return inc
