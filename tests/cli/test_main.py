"""`python -m sonar serve` end to end: exit codes, one-line errors, help, the summary it prints.

Serving itself (engine up, HTTP answered, SIGTERM → exit 0) is tested in tests/http.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sonar.cli import parse_serve_args
from sonar.cli.serve import describe, main

ROOT = Path(__file__).resolve().parents[2]

RUNS = {
    "missing-model": [
        "org/model",
        "--max-model-len",
        "4k",
        "--port",
        "8000",
        "--placement",
        "worker=process",
        "--trust-remote-code",
    ],
    "bad-value": ["--max-num-seqs", "abc"],
    "unsupported": ["--decode-context-parallel-size", "2"],
    "kv-dtype": ["--kv-cache-dtype", "fp8_e5m2"],
    "capture-sizes": ["--cudagraph-capture-sizes", "1", "8", "--max-cudagraph-capture-size", "16"],
}


@pytest.fixture(scope="module")
def runs() -> dict[str, subprocess.CompletedProcess]:
    """Each run is a fresh interpreter (~2 s of imports), so start them all at once."""
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "sonar", "serve", *argv],
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for name, argv in RUNS.items()
    }
    done = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done


def test_serve_prints_the_settings_then_a_missing_model_is_one_line_and_exit_1(runs) -> None:
    run = runs["missing-model"]
    assert run.returncode == 1, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("sonar serve: ")]
    assert len(errors) == 1
    assert errors[0].startswith("sonar serve: error: ")
    assert "model 'org/model' (revision main) is not a local path" in errors[0]
    lines = run.stdout.splitlines()
    assert all(line.startswith("sonar serve: ") for line in lines)
    assert "sonar serve: model: org/model" in lines
    assert "sonar serve: dtype: auto" in lines
    assert "sonar serve: max model len: 4000" in lines
    assert "sonar serve: listening on: http://0.0.0.0:8000 (all interfaces)" in lines
    assert "sonar serve: placement: worker=process, detokenizer=inprocess, scheduler=inprocess" in lines
    assert not any("no effect" in line for line in lines)


def test_bad_value_is_one_line_and_exit_2(runs) -> None:
    run = runs["bad-value"]
    assert run.returncode == 2
    assert run.stdout == ""
    assert run.stderr == "sonar serve: error: argument --max-num-seqs: expected an integer, got 'abc'\n"


def test_unsupported_flag_is_one_line_and_exit_2(runs) -> None:
    run = runs["unsupported"]
    assert run.returncode == 2
    assert (
        run.stderr == "sonar serve: --decode-context-parallel-size is not supported yet (got 2; Sonar accepts only 1)\n"
    )


def test_gpu_flag_errors_are_one_line_and_exit_2(runs) -> None:
    run = runs["kv-dtype"]
    assert run.returncode == 2
    assert run.stderr == (
        "sonar serve: --kv-cache-dtype is not supported yet (got fp8_e5m2; Sonar accepts only "
        "auto or bfloat16 or float16 or fp8 or fp8_e4m3)\n"
    )
    run = runs["capture-sizes"]
    assert run.returncode == 2
    assert run.stderr == (
        "sonar serve: error: max_cudagraph_capture_size 16 must equal the largest of "
        "cudagraph_capture_sizes (8) when both are given\n"
    )


def test_the_summary_names_the_placement_that_runs() -> None:
    """`serve` runs the worker in a child process unless `--placement` says otherwise; the
    summary says so, not the library's in-process default."""
    default = describe(parse_serve_args([]))
    assert "placement: worker=process, detokenizer=inprocess, scheduler=inprocess" in default
    chosen = describe(parse_serve_args(["--placement", "worker=inprocess,scheduler=process"]))
    assert "placement: worker=inprocess, detokenizer=inprocess, scheduler=process" in chosen


def test_describe_and_help_in_process(capsys) -> None:
    lines = describe(parse_serve_args(["--uds", "/tmp/sonar.sock", "--max-model-len", "auto"]))
    assert "listening on: unix:/tmp/sonar.sock" in lines
    assert "max model len: auto (the longest that fits the KV cache)" in lines
    assert main(["--help=max-model-len"]) == 0
    assert "--max-model-len MAX_MODEL_LEN" in capsys.readouterr().out
    assert main(["--help=zzzz"]) == 2
    assert capsys.readouterr().err == "sonar serve: error: --help: no flag or group matches 'zzzz'\n"
