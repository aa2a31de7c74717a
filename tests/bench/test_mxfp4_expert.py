"""`python -m sonar.bench.mxfp4_expert`: the MXFP4 kernel's and the dense products' figures for one
gpt-oss-20b expert, in both dtypes, printed in a fresh process (the command users run), with the
weights' bytes: MXFP4's 17 per 32 values against bfloat16's 64."""

from __future__ import annotations

import subprocess
import sys


def test_prints_the_quantized_and_dense_figures() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "sonar.bench.mxfp4_expert", "--rows", "1", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    # 5760x2880 + 2880x2880 weights: 17 / 32 bytes each in MXFP4 (13,219,200), 2 in bfloat16
    assert "weights: mxfp4 12.6 MiB, bfloat16 47.5 MiB" in lines[0], proc.stdout
    for kind in ("mxfp4 linear_quant   x", "dense F.linear"):
        for dtype in ("bfloat16", "float32"):
            row = [line for line in lines if line.startswith(kind) and dtype in line]
            assert len(row) == 1 and float(row[0].split()[-1]) > 0, proc.stdout
