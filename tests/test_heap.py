"""`sonar.heap`, each case in a fresh interpreter: the collector's state is the whole process's."""

import subprocess
import sys
import textwrap

import pytest

PRELUDE = """
import gc, weakref
from sonar import heap

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)
"""


def run(body: str) -> None:
    code = PRELUDE + textwrap.dedent(body)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_a_start_keeps_its_garbage_until_it_settles_then_collects_it_and_freezes_the_rest():
    run(
        """
        with heap.starting():
            assert not gc.isenabled()
            garbage = cycle()
            for _ in range(100_000):  # enough allocations for many collections, were any running
                cycle()
            assert garbage() is not None
            settled = heap.settle()
            assert settled.frozen == gc.get_freeze_count() > 0 and settled.seconds > 0
            assert garbage() is None  # the start's garbage was collected, not frozen
            assert gc.isenabled()
            assert heap.settle() is None  # once
            later = cycle()
            gc.collect()
            assert later() is None  # collections go on after the start
        assert gc.isenabled() and gc.get_freeze_count() > 0
        """
    )


def test_collect_all_reaches_a_frozen_cycle_and_freezes_what_survives_again():
    run(
        """
        with heap.starting():
            held = [Node()]
            held[0].other = held  # a cycle the start builds and holds (a worker's model)
            dropped = weakref.ref(held[0])
            kept = cycle()
            keep = kept()
            heap.settle()
        del held
        gc.collect()
        assert dropped() is not None  # frozen: an ordinary collection never sees it
        heap.collect_all()
        assert dropped() is None and kept() is keep
        assert gc.get_freeze_count() > 0 and gc.isenabled()
        """
    )


def test_collect_all_without_a_frozen_start_freezes_nothing():
    run(
        """
        garbage = cycle()
        heap.collect_all()
        assert garbage() is None and gc.get_freeze_count() == 0
        """
    )


def test_a_start_that_ends_unsettled_gets_its_collector_back_with_nothing_frozen():
    run(
        """
        try:
            with heap.starting():
                raise RuntimeError("the start failed")
        except RuntimeError:
            pass
        assert gc.isenabled() and gc.get_freeze_count() == 0
        assert heap.settle() is None
        """
    )


@pytest.mark.parametrize("enabled", [True, False])
def test_settle_without_a_pause_changes_nothing(enabled: bool):
    run(
        f"""
        if not {enabled}:
            gc.disable()
        assert heap.settle() is None
        assert gc.isenabled() is {enabled} and gc.get_freeze_count() == 0
        """
    )
