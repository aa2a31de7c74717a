"""What /proc says about a process tree: its members and the memory they hold between them."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from sonar.procfs import process_tree, proportional_bytes, resident_bytes, tree_proportional_bytes

#: A child that starts a grandchild holding 200 MiB of touched memory, then waits.
PARENT = (
    "import subprocess, sys, time\n"
    "subprocess.Popen([sys.executable, '-c', \"b = bytearray(200 << 20); print('ready', flush=True); "
    'import time; time.sleep(60)"])\n'
    "time.sleep(60)\n"
)


def test_a_tree_counts_its_grandchildren_memory() -> None:
    proc = subprocess.Popen([sys.executable, "-c", PARENT], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            tree = process_tree(proc.pid)
            if len(tree) == 2 and (tree_proportional_bytes(proc.pid) or 0) > 200 << 20:
                break
            time.sleep(0.1)
        assert len(tree) == 2 and tree[0] == proc.pid
        total = tree_proportional_bytes(proc.pid)
        assert total > 200 << 20
        # the child alone holds less than the tree: the grandchild's buffer is counted once
        assert proportional_bytes(proc.pid) < 100 << 20 < total
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


def test_a_process_that_is_gone_has_no_figures() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert resident_bytes(proc.pid) is None and proportional_bytes(proc.pid) is None
    assert tree_proportional_bytes(proc.pid) is None
    assert resident_bytes(os.getpid()) > 10 << 20
