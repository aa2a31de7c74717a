"""Which CPU cores a worker process computes on: its share of those it may use, and binding to them.

Data-parallel replicas split the cores between them (`sonar.engine.replicas`), and the ranks of a
parallel group split their replica's share again (`sonar.engine.ranks`), so processes that compute
side by side do not spread over the same cores.
"""

from __future__ import annotations

import os


def cpu_share(index: int, count: int, cores: list[int]) -> list[int]:
    """The cores member `index` of `count` computes on: an equal contiguous slice of `cores` (the
    first members get one more when they do not divide), or one core, shared round-robin, when there
    are fewer cores than members."""
    cores = sorted(cores)
    if len(cores) <= count:
        return [cores[index % len(cores)]]
    base, extra = divmod(len(cores), count)
    start = index * base + min(index, extra)
    return cores[start : start + base + (1 if index < extra else 0)]


def bind(cores: list[int]) -> list[int]:
    """Bind every thread of this process to `cores` and size torch's intra-op pool to them (at most
    ``OMP_NUM_THREADS`` when set); returns `cores`."""
    import torch

    for task in os.listdir("/proc/self/task"):  # threads started before this one inherit nothing
        try:
            os.sched_setaffinity(int(task), cores)
        except OSError:  # a thread that just ended
            pass
    threads = len(cores)
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) > 0:
        threads = min(threads, int(omp))
    torch.set_num_threads(threads)
    return cores


def share_of_mine(index: int, count: int) -> list[int]:
    """Member `index` of `count`'s share of the cores this process may run on, bound to."""
    return bind(cpu_share(index, count, sorted(os.sched_getaffinity(0))))
