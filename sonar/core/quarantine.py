"""Quarantine: which request crashes the worker, found by running suspects one at a time.

A request whose input makes the forward pass fail (a poison prompt, a kernel bug one shape
triggers) would crash the worker again each time it is recomputed after a restart, until the
engine's supervisor gives up and every client loses its requests. The scheduler core narrows such
a crash down to one request and fails that request alone:

1. When a step fails (the worker crashed or hung), every request of that step becomes a
   *suspect*.
2. Suspects run *isolated*: at most one suspect is admitted at a time, beside requests that are
   not suspects and have sampled before (a new request waits meanwhile: its prompt, never
   computed through, could fail the step itself and the suspect would take the blame). Suspects
   that had sampled before the crash go first: a poison prompt crashes the step that first
   computes it, so those are the likelier innocents. A suspect is cleared once a step in which
   it sampled (its recomputation reached past the point where it crashed) comes back.
3. A crashing step with exactly one suspect in it convicts that suspect, which is *quarantined*
   (failed with ``RequestQuarantinedError``, its blocks freed), when the engine has seen that a step
   without it can pass (a *witness*: a step came back while it waited) or when no other request is
   left to tell it apart. The requests beside it become suspects in turn and are cleared in the
   same way.
4. Without a witness, while other requests remain, the suspect is not convicted yet: it waits
   (``ready`` is false) until a step without it comes back, and suspects that are ready run first.

So a crash that follows one request ends that request after two crashes (three when its isolated
run happened to come before any witness, as when every request of the crashed step was new), and
the others complete. A crash that follows no request (every step fails) never finds a witness
while several requests are in flight: they keep failing until the supervisor's restart intensity
is spent and the engine gives up. Several poison requests left on their own look the
same and end the same way.

Pure bookkeeping on request ids: the scheduler core (`sonar.core.schedule`) calls it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

__all__ = ["Quarantine", "Suspect"]


@dataclass(slots=True)
class Suspect:
    crashes: int = 1
    """Failed steps it was in since it last became a suspect."""
    isolated_crashes: int = 0
    """Of those, steps in which it was the only suspect."""
    witnessed: bool = False
    """A step without it came back since its last isolated crash."""

    @property
    def ready(self) -> bool:
        """May run now: never failed alone yet, or a witness has come since."""
        return self.isolated_crashes == 0 or self.witnessed


class Quarantine:
    """The suspects by request id."""

    def __init__(self) -> None:
        self.suspects: dict[str, Suspect] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.suspects

    def __len__(self) -> int:
        return len(self.suspects)

    def __bool__(self) -> bool:
        return bool(self.suspects)

    def ready(self, request_id: str) -> bool:
        """Whether ``request_id`` may be admitted as the step's suspect (True for a non-suspect)."""
        suspect = self.suspects.get(request_id)
        return suspect is None or suspect.ready

    def crashed(self, step: Collection[str], live: Collection[str]) -> dict[str, int]:
        """A step of the requests ``step`` failed; ``live`` are all unfinished requests.

        Returns the requests to quarantine, each with the number of failed steps it was in (they
        are no longer suspects); the others of the step are suspects from now on.
        """
        in_step = [rid for rid in step if rid in self.suspects]
        convicted: dict[str, int] = {}
        if len(in_step) == 1:
            rid = in_step[0]
            suspect = self.suspects[rid]
            suspect.crashes += 1
            alone = all(other == rid for other in live)
            if suspect.witnessed or alone:
                convicted[rid] = suspect.crashes
                del self.suspects[rid]
            else:
                suspect.isolated_crashes += 1
        else:
            for rid in in_step:
                self.suspects[rid].crashes += 1
        for rid in step:
            if rid not in self.suspects and rid not in convicted:
                self.suspects[rid] = Suspect()
        return convicted

    def passed(self, sampled: Iterable[str], bystanders: Iterable[str]) -> None:
        """A step came back: suspects that sampled in it are cleared; ``bystanders``, suspects
        that were not in it, have a witness."""
        for rid in sampled:
            self.suspects.pop(rid, None)
        for rid in bystanders:
            suspect = self.suspects.get(rid)
            if suspect is not None:
                suspect.witnessed = True

    def discard(self, request_id: str) -> None:
        """The request finished (or was aborted): no longer a suspect."""
        self.suspects.pop(request_id, None)
