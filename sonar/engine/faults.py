"""`--fault-injection`: make the worker fail on purpose, for tests and drills.

A plan is a comma-separated list of `ACTION@step=N` (once, on the N-th model step the scheduler
sends, counted from 1 over the engine's life, so a restarted worker does not fail again),
`ACTION@p=P` (on each step, with probability P) or `ACTION@token=ID` (on each step whose input
holds token ID: a request whose prompt holds it fails every step that computes that part of it,
each time it is recomputed, as a poison request would; see `sonar.core.quarantine`). Actions:
`raise` (an exception in the forward pass), `hang` (the step never returns) and `exit` (the
worker's process exits at once, as an out-of-memory kill would; in-process, the worker crashes
instead). A trailing `@rank=R` makes rank R of a tensor/pipeline group carry the fault out instead
of rank 0 (`hang@step=5@rank=1`: a rank that stops answering while the others wait on it).

The scheduler owns the plan (it outlives worker restarts) and marks the steps that must fail;
the worker carries the fault out.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sonar.errors import SonarError

ACTIONS = ("raise", "hang", "exit")


class FaultSpecError(SonarError, ValueError):
    pass


@dataclass(frozen=True)
class Fault:
    action: str
    step: int | None = None
    probability: float | None = None
    token: int | None = None
    rank: int = 0
    """The rank of a tensor/pipeline group that carries it out."""


class FaultPlan:
    def __init__(self, faults: list[Fault], seed: int = 0) -> None:
        self.faults = faults
        self.steps = 0
        self._rng = random.Random(seed)

    @classmethod
    def parse(cls, text: str | None, seed: int = 0) -> "FaultPlan | None":
        if not text or not text.strip():
            return None
        faults = []
        for item in text.split(","):
            item = item.strip()
            action, sep, when = item.partition("@")
            when, _, rank_part = when.partition("@")
            rank = 0
            if rank_part:
                key, _, value = rank_part.partition("=")
                if key != "rank" or not value.isdigit():
                    raise FaultSpecError(f"fault {item!r}: after the condition only @rank=R (R an integer >= 0)")
                rank = int(value)
            if action not in ACTIONS or not sep:
                raise FaultSpecError(
                    f"fault {item!r}: expected ACTION@step=N, ACTION@p=P or ACTION@token=ID with "
                    f"ACTION one of {', '.join(ACTIONS)}"
                )
            key, _, value = when.partition("=")
            try:
                if key == "step":
                    step = int(value)
                    if step < 1:
                        raise ValueError
                    faults.append(Fault(action, step=step, rank=rank))
                elif key == "p":
                    p = float(value)
                    if not 0.0 <= p <= 1.0:
                        raise ValueError
                    faults.append(Fault(action, probability=p, rank=rank))
                elif key == "token":
                    token = int(value)
                    if token < 0:
                        raise ValueError
                    faults.append(Fault(action, token=token, rank=rank))
                else:
                    raise FaultSpecError(f"fault {item!r}: the condition is step=N, p=P or token=ID")
            except ValueError as exc:
                if isinstance(exc, FaultSpecError):
                    raise
                raise FaultSpecError(
                    f"fault {item!r}: step must be an integer >= 1, p a number in [0, 1], token an integer >= 0"
                ) from None
        return cls(faults, seed)

    def next_step(self, inputs: Iterable[Sequence[int]] = ()) -> str | None:
        """Count one more step, whose requests feed the token ids `inputs`; the action to carry
        out on it, if any."""
        fault = self.next_fault(inputs)
        return None if fault is None else fault.action

    def next_fault(self, inputs: Iterable[Sequence[int]] = ()) -> Fault | None:
        """`next_step`, with the fault that fires (its action and its rank)."""
        self.steps += 1
        tokens: set[int] | None = None
        for fault in self.faults:
            if fault.step is not None and fault.step == self.steps:
                return fault
            if fault.probability is not None and self._rng.random() < fault.probability:
                return fault
            if fault.token is not None:
                if tokens is None:
                    tokens = {t for ids in inputs for t in ids}
                if fault.token in tokens:
                    return fault
        return None
