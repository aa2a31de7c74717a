"""`python -m sonar bench startup`: one cold and one warm start of a real server."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import torch

from sonar.__main__ import main
from sonar.bench.launch import parse_startup_phases
from tests.bench.conftest import SERVER_ARGS
from tests.engine.conftest import save_word_tokenizer
from tests.models.conftest import _tiny_configs


def tiny_qwen3(path: Path) -> Path:
    """A tiny random Qwen3 with a word-level tokenizer: the command's mechanics are what is tested,
    and the embedded model's first-start conversion would add half a minute of CI time."""
    from transformers import AutoModelForCausalLM

    config = _tiny_configs()["qwen3"]
    config.max_position_embeddings = 512
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(path))
    save_word_tokenizer(path, config.vocab_size)
    return path


def test_startup_cold_and_warm(tmp_path: Path) -> None:
    out_json = tmp_path / "startup.json"
    server_args = ["--model", str(tiny_qwen3(tmp_path / "model")), *SERVER_ARGS]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(
            ["bench", "startup", "--runs", "1", "--timeout", "300", "--output-json", str(out_json), "--", *server_args]
        )
    report = out.getvalue()
    assert code == 0, report
    result = json.loads(out_json.read_text())
    assert [r["mode"] for r in result["runs"]] == ["cold", "warm"]
    for run in result["runs"]:
        assert run["exit_code"] == 0
        assert 0 < run["ready_s"] < run["first_token_s"] < 300
        assert 0 < run["ttft_s"] < run["first_token_s"]
        assert all(v >= 0 for v in run["phases"].values())
    cold, warm = result["summary"]["cold"], result["summary"]["warm"]
    for stats in (cold, warm):
        assert stats["ready_s"]["n"] == 1
        assert stats["ready_s"]["min"] == stats["ready_s"]["mean"] == stats["ready_s"]["max"]
    assert result["server_args"] == server_args
    assert "Startup Benchmark Result" in report and "ready (/health 200) (s)" in report


def test_startup_line_is_parsed_leniently() -> None:
    text = (
        "sonar serve: model: x\n"
        "sonar serve: startup: weights=1.25 convert=0.5s kv_cache=40ms warmup=2 ready=4.0 note=fast\n"
    )
    assert parse_startup_phases(text) == {
        "weights": 1.25,
        "convert": 0.5,
        "kv_cache": 0.04,
        "warmup": 2.0,
        "ready": 4.0,
    }
    assert parse_startup_phases("no such line\n") == {}
