"""Sleep mode's states and transitions (``--enable-sleep-mode``), as plain values.

An engine sleeps at a level and wakes by tags, with vLLM's meaning:

* level 1 frees the KV cache (its blocks and the prefix cache) and moves the weights off the
  device to host memory, where waking copies them back (on the CPU they stay where they are);
* level 2 frees the KV cache and drops the weights, which waking reads again from the checkpoint.

What is asleep is named by tags, ``weights`` and ``kv_cache``: `wake` wakes the tags it is given
(all by default), so a trainer can wake the weights, update them, then wake the KV cache. The
engine is asleep while any tag is. The worker holds the state (it owns the tensors); the
scheduler keeps a copy to refuse requests while asleep. Nothing here touches a tensor.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from sonar.errors import InvalidRequestError, SonarError

TAGS = ("weights", "kv_cache")
"""What sleeps, in the order waking restores it (the KV cache after the weights it belongs to)."""

LEVELS = (1, 2)


class SleepRefusedError(SonarError, RuntimeError):
    """A sleep or wake-up that cannot happen now: requests still ran when the drain timed out,
    another sleep or wake-up is under way, or the engine sleeps at another level. Nothing
    changed; HTTP answers 409."""

    status = 409


class SleepState(msgspec.Struct, frozen=True):
    level: int = 0
    """The level the engine went to sleep at; 0: awake."""
    asleep: tuple[str, ...] = ()
    """The tags not woken yet (in `TAGS` order)."""

    @property
    def is_sleeping(self) -> bool:
        return bool(self.asleep)


AWAKE = SleepState()


def check_level(level: object) -> int:
    """`level` as a sleep level, or `InvalidRequestError` naming it."""
    if isinstance(level, bool) or level not in LEVELS:
        raise InvalidRequestError(f"sleep level must be 1 or 2, got {level!r}", param="level")
    return int(level)  # type: ignore[call-overload]


def check_tags(tags: Iterable[str] | None) -> tuple[str, ...]:
    """The tags to wake, in `TAGS` order (None: all); `InvalidRequestError` for an unknown one."""
    if tags is None:
        return TAGS
    given = list(tags)
    unknown = [t for t in given if t not in TAGS]
    if unknown:
        raise InvalidRequestError(f"unknown wake-up tag {unknown[0]!r}; the tags are {', '.join(TAGS)}", param="tags")
    if not given:
        raise InvalidRequestError("no wake-up tag given; the tags are " + ", ".join(TAGS), param="tags")
    return tuple(t for t in TAGS if t in given)


def plan_sleep(state: SleepState, level: int) -> SleepState | None:
    """The state after sleeping at `level`, or None when the engine already sleeps that way (a
    repeated sleep changes nothing). Sleeping at another level while any tag is asleep is
    refused: wake it up first."""
    level = check_level(level)
    if state.asleep == TAGS and state.level == level:
        return None
    if state.is_sleeping:
        raise SleepRefusedError(
            f"the engine is asleep at level {state.level} ({', '.join(state.asleep)} asleep); wake it up "
            f"before it sleeps at level {level}"
        )
    return SleepState(level, TAGS)


def plan_wake(state: SleepState, tags: Iterable[str] | None = None) -> tuple[SleepState, tuple[str, ...]]:
    """The state after waking `tags` (None: all) and, in `TAGS` order, the tags that wake now
    (those asleep among them; waking an awake tag changes nothing)."""
    wanted = check_tags(tags)
    waking = tuple(t for t in state.asleep if t in wanted)
    left = tuple(t for t in state.asleep if t not in wanted)
    return SleepState(state.level if left else 0, left), waking
