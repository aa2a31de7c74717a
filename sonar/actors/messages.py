"""The message vocabulary every mailbox shares: the ask base, reply addresses, system messages.

An actor's protocol is a tagged union of `msgspec.Struct`s. A message that expects an answer
derives from `Ask`: `ask()` fills in `reply_to`, so the reply address travels inside the message
whichever mailbox carries it. The reply's type is the class variable `reply_type`.
"""

from __future__ import annotations

import traceback
import typing
from types import UnionType
from typing import Any, ClassVar

import msgspec

from sonar.errors import SonarError


class ReplyTo(msgspec.Struct, frozen=True, array_like=True):
    """Where a reply goes: the asking node, its pending-ask id, and (when bound) its address."""

    node: str
    id: int
    address: str | None = None


class Ask(msgspec.Struct, kw_only=True):
    """Base of messages that expect a reply. Subclasses set `reply_type` for a typed answer."""

    reply_type: ClassVar[Any] = Any
    reply_to: ReplyTo | None = None


class Ping(Ask, tag="sonar.ping"):
    """Liveness probe sent by a supervisor through the mailbox: a stuck actor cannot answer."""


class Pong(msgspec.Struct, tag="sonar.pong"):
    mailbox_depth: int
    pid: int


Ping.reply_type = Pong


class Stop(msgspec.Struct, tag="sonar.stop"):
    """Polite request to stop: the actor finishes the messages before it, runs `stopping()`, exits."""


SYSTEM_MESSAGES = (Ping, Stop)


class RemoteError(msgspec.Struct, frozen=True):
    """An exception as data, so it can cross a process boundary."""

    type: str
    message: str
    traceback: str = ""

    @classmethod
    def from_exception(cls, exc: BaseException) -> "RemoteError":
        return cls(
            type=f"{type(exc).__module__}.{type(exc).__qualname__}",
            message=str(exc),
            traceback="".join(traceback.format_exception(exc)),
        )


class ActorError(SonarError, RuntimeError):
    """Raised at the asker when the actor failed to handle the message (possibly in another process)."""

    def __init__(self, error: RemoteError, actor: str = "?") -> None:
        self.error = error
        self.actor = actor
        super().__init__(f"actor {actor!r} failed: {error.type}: {error.message}")


class AskTimeout(SonarError, TimeoutError):
    """No reply arrived within the ask's timeout."""


class ActorNotFound(SonarError, LookupError):
    """No actor of that name lives at that address (never started, or stopped for good)."""


class ExitInfo(msgspec.Struct, frozen=True):
    """How one run of an actor ended: normally (stop, `exit()`) or not (crash, kill, hang)."""

    normal: bool
    reason: str
    error: RemoteError | None = None


_types_cache: dict[Any, tuple[type, ...]] = {}


def protocol_types(protocol: Any) -> tuple[type, ...]:
    """The message classes of a protocol (a Struct class or a Union of tagged Structs)."""
    types = _types_cache.get(protocol)
    if types is None:
        args = typing.get_args(protocol) if typing.get_origin(protocol) in (typing.Union, UnionType) else ()
        types = tuple(args) if args else (protocol,)
        for t in types:
            if not (isinstance(t, type) and issubclass(t, msgspec.Struct)):
                raise TypeError(f"protocol member {t!r} is not a msgspec.Struct")
        if len(types) > 1:
            untagged = [t.__name__ for t in types if t.__struct_config__.tag is None]
            if untagged:
                raise TypeError(f"protocol structs must be tagged (tag=True): {', '.join(untagged)}")
        _types_cache[protocol] = types
    return types
