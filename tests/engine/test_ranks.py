"""The CPU cores of a tensor-parallel group's ranks (`sonar.engine.ranks.core_share`); joining the
group itself is exercised by tests/models/test_parallel.py and tests/engine/test_tensor_parallel.py."""

from __future__ import annotations

from sonar.engine.ranks import core_share


def test_ranks_share_the_cores_without_overlap_while_there_are_enough() -> None:
    cores = [0, 1, 2, 3, 4, 5]
    shares = [core_share(rank, 2, cores) for rank in range(2)]
    assert shares == [[0, 2, 4], [1, 3, 5]]
    assert [core_share(rank, 3, [4, 5, 6]) for rank in range(3)] == [[4], [5], [6]]


def test_more_ranks_than_cores_wrap_around_one_core_each() -> None:
    assert [core_share(rank, 3, [0, 1]) for rank in range(3)] == [[0], [1], [0]]
