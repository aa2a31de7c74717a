"""Every kernel, launched as the GPU path launches it (real model shapes, bf16 and float8 caches),
compiles for sm_90 (H100/H200) down to a cubin on this CPU machine: ``sonar.kernels.triton.aot``,
in a subprocess because this test session runs Triton's interpreter, which does not compile."""

from __future__ import annotations

import os
import subprocess
import sys


def test_kernels_compile_for_hopper() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "sonar.kernels.triton.aot", "--capability", "90"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    compiled = [line for line in proc.stdout.splitlines() if line.startswith("ok ")]
    assert len(compiled) >= 15, proc.stdout
    assert "aot: all kernels compiled" in proc.stdout
