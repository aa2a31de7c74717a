"""`python -m sonar bench collectives`: two real gloo ranks time a tensor-parallel decode step's
collectives at the embedded model's shapes and print one row per batch size."""

from __future__ import annotations

import subprocess
import sys


def test_two_ranks_time_the_collectives_of_a_step() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "sonar", "bench", "collectives", "--tp", "2", "--rows", "1,4", "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert "30 layers, hidden 576, vocabulary 49152" in lines[0]
    rows = [line.split("|")[1:-1] for line in lines if line.startswith("| ") and line[2].isdigit()]
    assert [int(r[0]) for r in rows] == [1, 4]
    for r in rows:
        per_call, calls, step = float(r[2]), int(r[3]), float(r[6])
        assert calls == 60 and 0 < per_call and per_call * calls <= step
