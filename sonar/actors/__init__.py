"""Sonar's actor runtime: typed mailboxes, placement, supervision (see docs/architecture.md)."""

from sonar.actors.actor import NO_REPLY, Actor, ActorExit
from sonar.actors.messages import ActorError, ActorNotFound, Ask, AskTimeout, ExitInfo, RemoteError
from sonar.actors.node import configure_transport
from sonar.actors.ref import ActorRef
from sonar.actors.spec import (
    ChildProcess,
    ChildSpec,
    InProcess,
    Placement,
    Remote,
    SiblingRef,
    SupervisorSpec,
    parse_placement,
)
from sonar.actors.supervisor import Supervisor, SupervisorGaveUp, run_root, supervise
from sonar.actors.tree import ActorInfo

__all__ = [
    "NO_REPLY",
    "Actor",
    "ActorError",
    "ActorExit",
    "ActorInfo",
    "ActorNotFound",
    "ActorRef",
    "Ask",
    "AskTimeout",
    "ChildProcess",
    "ChildSpec",
    "ExitInfo",
    "InProcess",
    "Placement",
    "Remote",
    "RemoteError",
    "SiblingRef",
    "Supervisor",
    "SupervisorGaveUp",
    "SupervisorSpec",
    "configure_transport",
    "parse_placement",
    "run_root",
    "supervise",
]
