"""What a peer may name: the actor classes an actor host spawns and the protocols a ref may carry.

A `Spawn` names its actor class as a `module:name` string, and an actor reference on the wire
names its protocol the same way. Importing whatever a peer names would let it call any function
of any installed module (`os:system`), so both go through this allow-list instead: nothing a
peer sends is imported unless it is on it.

On the list: the actor classes Sonar ships (`BUILTIN_ACTORS`) and the protocols their refs carry
(`BUILTIN_PROTOCOLS`), the classes this process's own code registers (`allow_actor`, which a
supervisor calls for every child it places, and `ActorRef` for every protocol it sends), and
those a deployment names in `SONAR_ACTOR_ALLOW` (comma-separated `module:name`) or with
`python -m sonar actor --allow-actor`. The protocol of an allowed actor class is allowed too.
A child process gets its parent's list for the actor it runs through its environment (the parent
chose the child's whole command line already, so that adds no power).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from sonar.actors.codec import import_path
from sonar.actors.messages import protocol_types
from sonar.errors import SonarError

ENV = "SONAR_ACTOR_ALLOW"

BUILTIN_ACTORS = frozenset(
    {
        "sonar.engine.worker:WorkerActor",
        "sonar.engine.scheduler:SchedulerActor",
        "sonar.engine.detokenizer:DetokenizerActor",
        "sonar.offload.manager:OffloadManagerActor",
        "sonar.bench.actors:BenchActor",
    }
)
"""The actor classes Sonar places in other processes (`sonar.engine.tree.engine_spec`, the
actor benchmark)."""

BUILTIN_PROTOCOLS = frozenset(
    {
        "sonar.actors.host:HostMsg",
        "sonar.protocol.engine:WorkerMsg",
        "sonar.protocol.engine:SchedulerMsg",
        "sonar.protocol.engine:DetokenizerMsg",
        "sonar.protocol.engine:FrontendMsg",
        "sonar.protocol.offload:OffloadMsg",
        "sonar.bench.actors:BenchMsg",
    }
)
"""Protocols of the refs Sonar's actors hand each other (the engine client's `FrontendMsg` sink
among them)."""


class NotAllowed(SonarError, ValueError):
    """A peer named an actor class or protocol that is not on the allow-list."""


_actors: set[str] = set(BUILTIN_ACTORS)
_protocols: set[str] = set(BUILTIN_PROTOCOLS)
_expanded: set[str] = set()  # allowed actor classes whose protocol was added already
_env_seen: str | None = None


def allow_actor(target: "str | type") -> str:
    """Put an actor class (or its `module:name`) on the list; returns the path."""
    path = target if isinstance(target, str) else import_path(target)
    _check_path(path)
    _actors.add(path)
    if not isinstance(target, str):
        _allow_protocol_of(path, target)
    return path


def allow_protocol(path: str) -> None:
    """Put a protocol's `module:name` on the list (a ref this process encodes names it)."""
    _protocols.add(path)


def actor_allowed(path: str) -> bool:
    _read_env()
    return path in _actors


def allowed_actors() -> list[str]:
    _read_env()
    return sorted(_actors)


def load_actor(path: str, base: type) -> type:
    """The actor class named `path` (a subclass of `base`), imported only when it is on the list."""
    if not actor_allowed(path):
        raise NotAllowed(
            f"actor class {path!r} is not on this host's allow-list "
            f"(python -m sonar actor --allow-actor {path}, or {ENV})"
        )
    cls = _import(path)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise NotAllowed(f"{path!r} is not an {base.__name__} class")
    _allow_protocol_of(path, cls)
    return cls


def load_protocol(path: str) -> Any:
    """The protocol named `path` (a ref received from a peer), imported only when it is on the list."""
    _read_env()
    if path not in _protocols:
        for actor in sorted(_actors - _expanded):  # the protocols of allowed classes not yet imported
            try:
                _allow_protocol_of(actor, _import(actor))
            except (ImportError, AttributeError):
                _expanded.add(actor)
        if path not in _protocols:
            raise NotAllowed(f"actor protocol {path!r} is not on the allow-list")
    return _import(path)


def _allow_protocol_of(path: str, cls: Any) -> None:
    _expanded.add(path)
    protocol = getattr(cls, "protocol", None)
    if protocol is not None:
        try:
            _protocols.add(protocol_path(protocol))
        except TypeError:  # not a module-level name: no ref of it can cross processes anyway
            pass


_paths: dict[Any, str] = {}


def protocol_path(protocol: Any) -> str:
    """The `module:name` a ref names its protocol by on the wire; a protocol this process sends
    a ref of is one it can decode a ref of."""
    path = _paths.get(protocol)
    if path is None:
        path = _paths[protocol] = import_path(protocol) if isinstance(protocol, type) else _union_path(protocol)
        allow_protocol(path)
    return path


def _union_path(protocol: Any) -> str:
    """A Union protocol has no import path of its own: name it by a module attribute holding it."""
    path = getattr(protocol, "__sonar_path__", None)
    if path:
        return path
    for t in protocol_types(protocol):
        module = __import__(t.__module__, fromlist=["_"])
        for attr, value in vars(module).items():
            if value == protocol:
                return f"{t.__module__}:{attr}"
    raise TypeError(f"protocol {protocol!r} must be a module-level name to cross processes")


def _read_env() -> None:
    global _env_seen
    raw = os.environ.get(ENV, "")
    if raw != _env_seen:
        _env_seen = raw
        for path in raw.split(","):
            if path.strip():
                allow_actor(path.strip())


def _check_path(path: str) -> None:
    module, sep, name = path.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"expected module:name, got {path!r}")


def _import(path: str) -> Any:
    module, _, qual = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj
