"""`python -m sonar.bench.quant_paths`: one figure per path this CPU runs and dtype, and the dense
references, printed in a fresh process (the command users run)."""

from __future__ import annotations

import subprocess
import sys

from sonar.kernels import native


def test_prints_every_runnable_path() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "sonar.bench.quant_paths", "--rows", "1", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    best = native.best_isa(native.cpu_flags())
    lines = proc.stdout.splitlines()
    assert f"CPU flags say: {best}" in lines[0]
    for isa in native.ISAS[: native.ISAS.index(best) + 1]:
        for dtype in ("bfloat16", "float32"):
            row = [line for line in lines if line.split()[:3] == ["linear_quant", isa, dtype]]
            assert len(row) == 1 and float(row[0].split()[-1]) > 0, proc.stdout
    assert sum(line.startswith("dense F.linear") for line in lines) == 2
