"""The goals `bench compare` judges per cell, on the mean over rounds."""

from __future__ import annotations

import pytest

from sonar.bench.compare_report import cell_checks, format_markdown, judge


def _run(tput: float, ttft: float, tpot: float, failed: int = 0) -> dict:
    return {
        "output_throughput": tput,
        "mean_ttft_ms": ttft,
        "mean_tpot_ms": tpot,
        "median_tpot_ms": tpot,
        "failed": failed,
    }


def test_load_goals_are_against_the_best_peer_on_each_metric() -> None:
    runs = {
        "sonar": [_run(800, 300, 17), _run(840, 320, 17)],
        "llama.cpp": [_run(450, 1000, 25)],
        "vllm": [_run(380, 900, 35)],
    }
    checks = {c.name: c for c in cell_checks(16, runs, "sonar", floor_ms=6.0)}
    assert set(checks) == {"tok/s", "TTFT"}, "the floor is a concurrency-1 goal"
    assert checks["tok/s"].ratio == pytest.approx(820 / 450) and checks["tok/s"].met
    # the best TTFT is vLLM's, though llama.cpp has the best throughput
    assert checks["TTFT"].ratio == pytest.approx(310 / 900) and checks["TTFT"].met


def test_single_stream_goals_are_the_floor_and_ttft() -> None:
    runs = {"sonar": [_run(130, 20, 7.0)], "llama.cpp": [_run(135, 22, 6.8)]}
    checks = {c.name: c for c in cell_checks(1, runs, "sonar", floor_ms=6.0)}
    assert checks["TPOT/floor"].ratio == pytest.approx(7.0 / 6.0) and not checks["TPOT/floor"].met
    assert checks["TTFT"].ratio == pytest.approx(20 / 22) and not checks["TTFT"].met
    assert cell_checks(2, runs, "sonar", floor_ms=6.0) == [], "between 1 and 4 no goal applies"


def test_failed_runs_are_not_judged() -> None:
    good = _run(800, 300, 17)
    assert cell_checks(16, {"sonar": [_run(800, 300, 17, failed=1)], "peer": [good]}, "sonar", None) == []
    # a peer that failed requests is not the bar to beat
    checks = cell_checks(
        16, {"sonar": [good], "peer": [_run(9000, 1, 1, failed=3)], "ok": [_run(400, 600, 30)]}, "sonar", None
    )
    assert {c.name: round(c.ratio, 3) for c in checks} == {"tok/s": 2.0, "TTFT": 0.5}


def test_the_markdown_names_each_server_and_the_spread_over_rounds() -> None:
    cell = {"workload": "random", "concurrency": 16, "input_len": 128, "output_len": 128}
    cell["runs"] = {
        "sonar": [_run(805, 316, 16.5), _run(847, 321, 17.4)],
        "llama.cpp": [_run(450, 1010, 25.1, failed=2)],
    }
    cell["checks"] = [c.to_dict() for c in cell_checks(16, cell["runs"], "sonar", None)]
    md = format_markdown(
        {
            "date": "2026-12-02T00:00:00Z",
            "subject": "sonar",
            "floor": {"weight_bytes": 269e6, "bandwidth_gbs": 40.0, "floor_ms": 6.725},
            "servers": [
                {"name": "sonar", "ready_s": 4.2, "peak_pss_bytes": 900 << 20},
                {"name": "llama.cpp", "ready_s": 1.0},
            ],
            "cells": [cell],
        }
    )
    assert "269 MB of weights / 40.0 GB/s measured read bandwidth = 6.72 ms" in md
    assert "| sonar | 4.2 | 900 |" in md and "| llama.cpp | 1.0 | n/a |" in md
    assert "| 16 | 128 | 805.0–847.0 | 450.0 (2 failed) |" in md
    # the peer failed requests: nothing is judged against it
    assert md.rstrip().endswith("Goals met: 0 of 0.")


def test_a_partial_result_is_reported_on_the_runs_it_has() -> None:
    """Written after every run: a cell with no runs yet, or only the subject's, is listed and judged
    on what it has, and the report says how many of the planned runs are in."""
    done = {"workload": "random", "concurrency": 4, "input_len": 128, "output_len": 128}
    done["runs"] = {"sonar": [_run(800, 300, 17)], "peer": [_run(400, 600, 30)]}
    half = {"workload": "random", "concurrency": 16, "input_len": 128, "output_len": 128}
    half["runs"] = {"sonar": [_run(900, 350, 18)]}
    empty = {"workload": "shared-prefix", "concurrency": 4, "input_len": 1152, "prefix_len": 1024, "output_len": 128}
    cells = [done, half, empty]
    judge(cells, "sonar", floor_ms=6.0)
    assert {c["name"]: c["ratio"] for c in done["checks"]} == {"tok/s": 2.0, "TTFT": 0.5}
    assert half["checks"] == [] and empty["checks"] == [], "no peer to judge against yet"
    result = {
        "date": "2026-12-04T00:00:00Z",
        "subject": "sonar",
        "floor": None,
        "servers": [{"name": "sonar", "ready_s": 4.2}, {"name": "peer", "ready_s": 1.0}],
        "cells": cells,
        "runs_planned": 12,
    }
    md = format_markdown(result)
    assert "\npartial: 3 of 12 runs\n" in md
    assert "| 16 | 128 | 900.0 | n/a | 350 | n/a | 18.0 | n/a | — |" in md
    assert "| 4 | 1024+128 | n/a | n/a | n/a | n/a | n/a | n/a | — |" in md
    assert md.rstrip().endswith("Goals met: 2 of 2.")
    assert "partial: 3 of 12 runs, stopped by SIGTERM" in format_markdown({**result, "stopped_by": "SIGTERM"})
    assert "partial" not in format_markdown({**result, "runs_planned": 3}), "all runs are in"
