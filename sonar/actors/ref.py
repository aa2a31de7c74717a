"""`ActorRef[Msg]`: the only way to talk to an actor, wherever it runs."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import anyio
import msgspec

from sonar.actors.allow import protocol_path
from sonar.actors.messages import SYSTEM_MESSAGES, Ask, AskTimeout, protocol_types
from sonar.actors.node import Node, get_node

Msg = TypeVar("Msg")


class ActorRef(Generic[Msg]):
    """A handle on a named actor: `send` (fire and forget) and `ask` (request/reply).

    `address` is None for an actor in this process, or the ZMQ address of the node that hosts it
    (an ipc path for a child process, `tcp://host:port` for a remote one). Sending code cannot
    tell which one it holds. Messages must not be mutated after they were sent: in-process the
    receiver gets the very same object.
    """

    __slots__ = ("name", "protocol", "address", "_types", "_allowed")

    def __init__(self, name: str, protocol: Any, address: str | None = None) -> None:
        self.name = name
        self.protocol = protocol
        self.address = address
        self._types = protocol_types(protocol)
        self._allowed = self._types + SYSTEM_MESSAGES

    @property
    def label(self) -> str:
        """The actor's name as its supervisor knows it (without the tree qualifier)."""
        return self.name.split(".", 1)[-1]

    def _check(self, msg: Any) -> None:
        if not isinstance(msg, self._allowed):
            names = ", ".join(t.__name__ for t in self._types)
            raise TypeError(f"actor {self.label!r} does not accept {type(msg).__qualname__}; its protocol is: {names}")

    async def send(self, msg: Msg) -> None:
        """Deliver `msg`; waits while the mailbox is full (backpressure), never drops it."""
        self._check(msg)
        await get_node().deliver(self.name, self.address, msg)

    async def ask(self, msg: Msg, timeout: float | None = None) -> Any:
        """Deliver `msg` and wait for the actor's reply (of `type(msg).reply_type`).

        Raises `AskTimeout` when no reply comes in `timeout` seconds and `ActorError` when the
        actor failed while handling it.
        """
        if timeout is None:
            return await (await self.ask_soon(msg)).result()
        try:
            with anyio.fail_after(timeout):  # the delivery (a full mailbox) counts too
                return await (await self.ask_soon(msg)).result()
        except TimeoutError:
            raise AskTimeout(f"actor {self.label!r} did not answer {type(msg).__qualname__} in {timeout} s") from None

    async def ask_soon(self, msg: Msg) -> PendingReply:
        """Deliver `msg` now and return its reply to await later (`PendingReply.result`): asks
        delivered one after another reach the actor in that order, while the asker goes on (the
        scheduler sends step N+1 before step N's result is back)."""
        self._check(msg)
        if not isinstance(msg, Ask):
            raise TypeError(f"{type(msg).__qualname__} expects no reply: derive it from sonar.actors.Ask")
        node = get_node()
        reply_to, fut = node.new_ask(type(msg).reply_type, self.label, self.name, self.address)
        try:
            await node.deliver(self.name, self.address, msgspec.structs.replace(msg, reply_to=reply_to))
        except BaseException:
            node.forget_ask(reply_to.id)
            raise
        return PendingReply(fut, reply_to.id, self.label, type(msg).__qualname__)

    def __sonar_ref__(self) -> tuple[str, str | None, str]:
        address = self.address
        if address is None:
            address = get_node().ensure_bound()
        return (self.name, address, protocol_path(self.protocol))

    def __repr__(self) -> str:
        where = self.address or "local"
        return f"ActorRef({self.name!r} @ {where})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ActorRef) and (self.name, self.address) == (other.name, other.address)

    def __hash__(self) -> int:
        return hash((self.name, self.address))


Node.make_ref = ActorRef


class PendingReply:
    """The reply to an ask already delivered (`ActorRef.ask_soon`)."""

    __slots__ = ("_future", "_id", "_label", "_name")

    def __init__(self, future: Any, ask_id: int, label: str, name: str) -> None:
        self._future = future
        self._id = ask_id
        self._label = label
        self._name = name

    async def result(self, timeout: float | None = None) -> Any:
        """Wait for the reply, as `ActorRef.ask` does: `AskTimeout` when none comes in `timeout`
        seconds from now, `ActorError` when the actor failed while handling the ask."""
        try:
            if timeout is None:
                return await self._future
            with anyio.fail_after(timeout):
                return await self._future
        except TimeoutError:
            raise AskTimeout(f"actor {self._label!r} did not answer {self._name} in {timeout} s") from None
        finally:
            get_node().forget_ask(self._id)

    def abandon(self) -> None:
        """Nobody will wait for this reply (its asker is stopping): forget the ask, and let a
        failure that still comes (the actor stopping too) go unreported."""
        get_node().forget_ask(self._id)
        self._future.add_done_callback(_consume)


def _consume(future: Any) -> None:
    if not future.cancelled():
        future.exception()
