"""The root supervisor as a real process: its exit code, its logs, its children."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.actors.helpers import alive

ENV = dict(os.environ, PYTHONPATH=os.getcwd(), SONAR_LOG_LEVEL="info")


@pytest.mark.parametrize("placement", ["inprocess", "process"])
def test_crash_loop_makes_the_root_exit_non_zero_with_no_child_left(placement):
    proc = subprocess.run(
        [sys.executable, "-m", "tests.actors.rootproc", "crashloop", placement],
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    pids = {int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("pid ")}
    assert pids
    assert not any(alive(p) for p in pids)
    log = proc.stderr
    for event in (
        "actor.start",
        "actor.ready",
        "actor.crash",
        "actor.restart",
        "supervisor.give_up",
        "actor.stopped",
        "supervisor.root_exit",
    ):
        assert event in log, f"{event} missing from the logs"
    assert "flaky was told to crash" in log  # the crash's traceback is logged with the child's name
    assert "actor=flaky" in log
    # the inner supervisor gave up first; its parent restarted it, then gave up itself
    assert log.count("supervisor.give_up") >= 2


@pytest.mark.parametrize("placement", ["inprocess", "process"])
def test_sigterm_stops_the_tree_in_order_and_exits_zero(placement):
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.actors.rootproc", "serve", placement],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    pids = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("pid "):
            pids.append(int(line.split()[1]))
        if line.strip() == "ready" or not line:
            break
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-3000:]
    assert not any(alive(p) for p in pids if p != proc.pid)
    stopped = [line.split("actor=")[1].split()[0] for line in err.splitlines() if "actor.stopped" in line]
    assert stopped == ["flaky", "inner", "steady"]  # reverse start order, depth first
