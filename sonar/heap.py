"""Python's cyclic garbage collector around a process's start.

A start builds a heap of ~250,000 long-lived objects (torch, transformers, the model, the HTTP
app) while the collector keeps running: `sonar serve`'s own process made five full collections of
up to 120 ms each. Paused until ready, a server answers its first 200 from `/health` ~0.6 s
sooner (BENCHMARKS.md). Once the process is ready, one collection takes the start's garbage, and
what survives is frozen (`gc.freeze`): the collector never walks it again, so a full collection
while serving looks only at what serving made instead of stalling on the whole start.

Only the processes Sonar owns pause: `sonar serve` and the actor hosts it starts as children.
The library (`sonar.open`) leaves its caller's collector alone.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from typing import NamedTuple

_paused = False


class Settled(NamedTuple):
    """What `settle` did: the objects it froze, and the seconds its collection took."""

    frozen: int
    seconds: float


def pause() -> None:
    """Stop automatic collections until `settle` (or `starting`'s end)."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def settle() -> Settled | None:
    """The start is over: collect its garbage once, freeze what survives, collect again from now
    on. None, doing nothing, unless `pause` paused."""
    global _paused
    if not _paused:
        return None
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    gc.enable()
    _paused = False
    return Settled(gc.get_freeze_count(), time.perf_counter() - started)


def collect_all() -> None:
    """A full collection that reaches the frozen start too, for a caller that just let go of
    something the start built (a sleeping worker its model, which sits in reference cycles): frozen
    objects are never collected, so they are unfrozen for this one collection, and what survives
    it is frozen again."""
    frozen = gc.get_freeze_count() > 0
    gc.unfreeze()
    gc.collect()
    if frozen:
        gc.freeze()


@contextlib.contextmanager
def starting() -> Iterator[None]:
    """`pause` for the block; a start that ends before `settle` (it failed, or was stopped)
    gets its collector back as it was, nothing frozen."""
    global _paused
    pause()
    try:
        yield
    finally:
        if _paused:
            gc.enable()
            _paused = False
