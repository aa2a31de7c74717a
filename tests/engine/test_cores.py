"""Which cores a worker process computes on (`sonar.engine.cores`): the shares, and the binding of
every thread of a real process to one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from sonar.engine.cores import cpu_share


def test_members_get_contiguous_shares_of_the_cores() -> None:
    assert [cpu_share(i, 2, [0, 1, 2, 3]) for i in range(2)] == [[0, 1], [2, 3]]
    assert [cpu_share(i, 3, list(range(8))) for i in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert [cpu_share(i, 2, [5, 1]) for i in range(2)] == [[1], [5]]
    assert [cpu_share(i, 3, [0, 1]) for i in range(3)] == [[0], [1], [0]]  # fewer cores: shared


def test_binding_covers_threads_started_before_it_and_sizes_torch() -> None:
    """A process with a thread already running binds to member 1 of 2's share: both threads and
    torch's pool follow (a replica's ranks split the replica's share again the same way)."""
    code = """
import json, os, threading, time
import torch
from sonar.engine.cores import share_of_mine
stop = threading.Event()
early = threading.Thread(target=stop.wait)
early.start()
share = share_of_mine(1, 2)
tasks = {int(t): sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
print(json.dumps({"share": share, "tasks": list(tasks.values()), "threads": torch.get_num_threads()}))
stop.set()
"""
    env = {**os.environ, "OMP_NUM_THREADS": "8"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    mine = sorted(os.sched_getaffinity(0))
    assert got["share"] == cpu_share(1, 2, mine)
    assert len(got["tasks"]) >= 2 and all(t == got["share"] for t in got["tasks"])
    assert got["threads"] == len(got["share"])
