"""The live supervision tree as data, for `/actors`, metrics and tests."""

from __future__ import annotations

import msgspec


class ActorInfo(msgspec.Struct):
    name: str
    kind: str  # "actor" | "supervisor"
    placement: str  # "inprocess" | "process" | an address
    pid: int | None
    state: str  # starting | running | stopping | stopped | crashed
    restarts: int
    mailbox_depth: int | None
    started_at: float | None  # wall-clock time the current run became ready
    last_exit: str | None = None
    children: list["ActorInfo"] = []

    def find(self, name: str) -> "ActorInfo | None":
        """The node of this subtree named `name` (depth first)."""
        if self.name == name:
            return self
        for child in self.children:
            hit = child.find(name)
            if hit is not None:
                return hit
        return None
