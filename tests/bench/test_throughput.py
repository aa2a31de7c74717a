"""`python -m sonar bench throughput`: offline, through `sonar.open()` in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.bench.conftest import env_of_subprocess

ROOT = Path(__file__).resolve().parents[2]


def test_throughput_report(tmp_path: Path) -> None:
    out = tmp_path / "throughput.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sonar",
            "bench",
            "throughput",
            "--dtype",
            "float32",
            "--max-model-len",
            "512",
            "--kv-cache-memory-bytes",
            "256M",
            "--max-num-seqs",
            "4",
            "--num-prompts",
            "5",
            "--random-input-len",
            "24",
            "--random-output-len",
            "6",
            "--output-json",
            str(out),
        ],
        cwd=ROOT,
        env=env_of_subprocess(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["num_requests"] == 5
    assert result["total_output_tokens"] == 5 * 6  # EOS is ignored: each request makes all its tokens
    assert result["total_input_tokens"] >= 5
    assert result["elapsed_time"] > 0
    for key in ("requests_per_second", "input_tokens_per_second", "output_tokens_per_second", "tokens_per_second"):
        assert result[key] > 0, key
    assert result["tokens_per_second"] > result["output_tokens_per_second"]
    assert result["engine_args"]["max_num_seqs"] == 4
    assert "Offline Throughput Result" in proc.stdout and "Output token throughput (tok/s):" in proc.stdout
