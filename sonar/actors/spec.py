"""What a supervisor is told to run: child specs, supervisor specs, placements."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Union

import msgspec

Restart = Literal["permanent", "transient", "temporary"]
Strategy = Literal["one_for_one", "one_for_all", "rest_for_one"]


class InProcess(msgspec.Struct, frozen=True, tag="inprocess"):
    """A task in the supervisor's own event loop: no serialization, lowest latency."""


class ChildProcess(msgspec.Struct, frozen=True, tag="process"):
    """A spawned `python -m sonar actor` process on this machine that connects back over ipc."""

    start_timeout: float = 60.0


class Remote(msgspec.Struct, frozen=True, tag="remote"):
    """An actor host already listening at `address` (`python -m sonar actor --listen ADDRESS`)."""

    address: str
    start_timeout: float = 60.0


OWN_GPU_ENV = "SONAR_OWN_GPU"
"""Set in a host that Ray gave one GPU of its own (it sees only that one, as device 0)."""
RENDEZVOUS_HOST_ENV = "SONAR_RENDEZVOUS_HOST"
"""Set in the hosts of a group Ray spread over several nodes: the address of the serving process's
node, which the others reach (the group's rank 0 opens its rendezvous there, not on loopback)."""


class RayBundle(msgspec.Struct, frozen=True, tag="ray"):
    """A `python -m sonar actor` process kept by a Ray actor in bundle `bundle` of the placement
    group its supervisor's children share (`sonar.actors.ray_runner`): Ray places the process, the
    supervisor runs it as a child process. Chosen by a launcher (the ``ray`` executor backend),
    not by a placement flag."""

    bundle: int
    bundles: int
    start_timeout: float = 60.0
    place_timeout: float = 60.0
    """Seconds Ray may take to place the whole group."""
    port: int | None = None
    """Where this rank's host listens (tcp, CURVE) when Ray places it on another node than the
    serving process's; None keeps the whole group on the serving process's node."""
    anywhere: bool = False
    """Rank 0 may run on another node than the serving process's too (a data-parallel replica
    placed by Ray, ``--data-parallel-backend ray``: it reaches its scheduler over tcp, as a
    headless node's replica does); False keeps it on the serving process's node."""


Placement = Union[InProcess, ChildProcess, Remote]


def parse_placement(value: "str | Placement") -> Placement:
    """`inprocess`, `process` or `tcp://host:port` (as written in flags and config files)."""
    if isinstance(value, (InProcess, ChildProcess, Remote)):
        return value
    text = value.strip()
    if text in ("inprocess", "in-process", "thread", "local"):
        return InProcess()
    if text in ("process", "child", "subprocess"):
        return ChildProcess()
    if text.startswith(("tcp://", "ipc://")):
        return Remote(text)
    raise ValueError(f"unknown placement {value!r}: expected inprocess, process or tcp://host:port")


def placement_name(p: Placement) -> str:
    if isinstance(p, Remote):
        return p.address
    return "process" if isinstance(p, ChildProcess) else "inprocess"


@dataclass(frozen=True)
class SiblingRef:
    """A kwarg placeholder: replaced, when the child starts, by the reference to the sibling named
    `name` under the same supervisor. A sibling started later is named by the reference it will
    have (its mailbox name and address do not change across runs); until it runs, a message to it
    fails with `ActorNotFound` in-process or waits in its queue across processes.

    `name` may be a path: ``group/child`` a child of the sibling supervisor ``group`` (started
    already), ``../name`` a sibling of this supervisor's own."""

    name: str


@dataclass
class ChildSpec:
    """One supervised actor.

    `actor` is the Actor subclass (or its `module:Class` path); it is built as `actor(**kwargs)`,
    in another process when placed there, so kwargs must then be msgspec-encodable.
    `shutdown` is the polite-stop deadline in seconds; `ping_interval=None` turns liveness off.
    `protocol`: the message type the actor takes (its class's `protocol`); given with a path,
    the supervisor makes refs to the child without importing its module, which then happens only
    where and when the actor starts (an actor in another process: there, at once, while this
    process gets on with its own start).
    """

    name: str
    actor: Any
    kwargs: dict[str, Any] = field(default_factory=dict)
    placement: Placement = field(default_factory=InProcess)
    restart: Restart = "permanent"
    shutdown: float = 5.0
    ping_interval: float | None = 1.0
    ping_timeout: float = 5.0
    mailbox_size: int = 1024
    protocol: Any = None


@dataclass
class SupervisorSpec:
    """A supervisor: its children (actors or supervisors) in start order, and its policy.

    More than `max_restarts` restarts within `period` seconds make it stop all its children and
    fail to its parent (the root then exits the process non-zero). The period is counted without
    the time the supervisor spends starting children, so slow starts do not hide a crash loop.
    """

    name: str
    children: list["ChildSpec | SupervisorSpec"]
    strategy: Strategy = "one_for_one"
    max_restarts: int = 3
    period: float = 5.0
    start_together: bool = False
    """Start (and restart) the children at once rather than in order: for children that do not
    need each other ready (a message to a sibling still starting waits in its queue across
    processes). Stopping stays in reverse order."""
    restart: Restart = "permanent"
    shutdown: float | None = None
