"""`python -m sonar bench sweep`: a two-point grid, one real server per point."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

from sonar.__main__ import main
from tests.bench.conftest import SERVER_ARGS, assert_png


def test_sweep_two_points(tmp_path: Path) -> None:
    plot = tmp_path / "sweep.png"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(
            [
                "bench",
                "sweep",
                "--param",
                "max-num-seqs=1,4",
                "--num-prompts",
                "4",
                "--random-input-len",
                "16",
                "--random-output-len",
                "4",
                "--ignore-eos",
                "--disable-tqdm",
                "--server-timeout",
                "300",
                "--save-result",
                "--result-dir",
                str(tmp_path),
                "--result-filename",
                "sweep.json",
                "--plot",
                str(plot),
                "--",
                *SERVER_ARGS,
            ]
        )
    report = out.getvalue()
    assert code == 0, report
    result = json.loads((tmp_path / "sweep.json").read_text())
    assert result["grid"] == {"max-num-seqs": ["1", "4"]}
    assert [p["params"] for p in result["points"]] == [{"max-num-seqs": "1"}, {"max-num-seqs": "4"}]
    for point in result["points"]:
        r = point["result"]
        assert r["completed"] == 4 and r["failed"] == 0
        assert r["total_output_tokens"] == 16
        assert r["output_throughput"] > 0 and r["mean_ttft_ms"] > 0
        assert point["server_ready_s"] > 0
    # One sequence at a time: the server never runs more than one request.
    assert result["points"][0]["result"]["server"]["peak_running_requests"] <= 1
    assert "Sweep Result" in report and "max-num-seqs" in report
    assert_png(plot)
