"""The operator's flags on a real `python -m sonar serve`: --log-config-file, --log-error-stack,
--enable-logging-iteration-details, --enable-per-request-metrics and
--no-enable-server-load-tracking, one server for all.

The logging configuration sends Sonar's and uvicorn's loggers to a file (and nowhere else), with
the process id in each line, so the test tells the server's lines from its worker process's.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from sonar.cli import parse_serve_args
from sonar.cli.serve import main
from tests.http.conftest import ServerProcess, serving, sse_events

SERVER_ARGS = ("--dtype", "float32", "--max-model-len", "256", "--num-gpu-blocks-override", "64", "--seed", "0")


def log_config(path: Path) -> dict[str, Any]:
    handler = {"class": "logging.FileHandler", "filename": str(path), "formatter": "plain"}
    only_file = {"handlers": ["file"], "level": "INFO", "propagate": False}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(process)d %(name)s %(levelname)s %(message)s"}},
        "handlers": {"file": handler},
        "loggers": {"sonar": only_file, "uvicorn": only_file, "uvicorn.access": only_file},
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    tmp = tmp_path_factory.mktemp("operations")
    logfile = tmp / "sonar.log"
    config = tmp / "logging.json"
    config.write_text(json.dumps(log_config(logfile)))
    flags = (
        *("--log-config-file", str(config), "--log-error-stack", "--enable-logging-iteration-details"),
        "--enable-per-request-metrics",
    )
    with serving(tmp, *SERVER_ARGS, *flags, "--no-enable-server-load-tracking") as srv:
        yield srv, logfile


@pytest.fixture(scope="module")
def http(server: tuple[ServerProcess, Path]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server[0].base_url, timeout=60) as c:
        yield c


def wait_for(logfile: Path, pattern: str, timeout: float = 10.0) -> str:
    """The log file's text once a line matches `pattern` (log lines are written as they happen)."""
    deadline = time.monotonic() + timeout
    while True:
        text = logfile.read_text(errors="replace") if logfile.exists() else ""
        if re.search(pattern, text, re.MULTILINE):
            return text
        assert time.monotonic() < deadline, f"no line matching {pattern!r} in:\n{text[-4000:]}"
        time.sleep(0.1)


def test_log_config_file_routes_sonar_and_uvicorn_loggers(server: tuple[ServerProcess, Path], http) -> None:
    srv, logfile = server
    r = http.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 2})
    assert r.status_code == 200, r.text
    text = wait_for(logfile, r'uvicorn\.access INFO .*"POST /v1/completions HTTP/1\.1" 200')
    pid = srv.proc.pid
    assert re.search(rf"^{pid} uvicorn\.error INFO Uvicorn running on", text, re.MULTILINE)
    assert re.search(rf"^{pid} sonar\.actors INFO actor\.ready actor=scheduler", text, re.MULTILINE)
    # The worker process applied the same configuration.
    worker = re.search(r"^(\d+) sonar\.runner INFO kv_cache\.allocated", text, re.MULTILINE)
    assert worker is not None and int(worker.group(1)) != pid, text[-4000:]
    # Nothing of it reached stderr, which the configuration does not name.
    assert "actor.ready" not in srv.log() and "POST /v1/completions" not in srv.log()


def test_iteration_details_log_each_step(server: tuple[ServerProcess, Path], http) -> None:
    _, logfile = server
    prompt = "The lighthouse keeper counted the ships"
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200, r.text
    n = r.json()["usage"]["prompt_tokens"]
    text = wait_for(logfile, rf"scheduler\.iteration context_requests=1 context_tokens={n} ")
    prefill = re.findall(
        rf"sonar\.scheduler INFO scheduler\.iteration context_requests=1 context_tokens={n} elapsed_ms=([\d.]+) "
        r"generation_requests=0 generation_tokens=0 step=(\d+) worker_ms=([\d.]+)",
        text,
    )
    assert prefill, text[-3000:]
    elapsed, step, worker = prefill[-1]
    assert float(elapsed) >= float(worker) > 0
    # The two tokens after its first come from the next step: one multi-step decode of two decode
    # steps (the request's room), one token each
    decode = re.search(
        r"scheduler\.iteration context_requests=0 context_tokens=0 decode_steps=2 elapsed_ms=[\d.]+ "
        rf"generation_requests=1 generation_tokens=2 step={int(step) + 1} ",
        wait_for(logfile, rf"generation_tokens=2 step={int(step) + 1} "),
    )
    assert decode, text[-3000:]


def test_log_error_stack_logs_the_traceback_of_a_refusal(server: tuple[ServerProcess, Path], http) -> None:
    _, logfile = server
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": -1})
    assert r.status_code == 400, r.text
    text = wait_for(logfile, r"sonar\.http WARNING request\.error request_id=cmpl-\S+ status=400")
    after = text[text.rindex("request.error request_id=cmpl-") :]
    assert "Traceback (most recent call last):" in after
    assert "RequestError: invalid request: Expected `int` >= 0 - at `$.max_tokens`" in after


METRICS = {"time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms", "tokens_per_second"}


def check_metrics(metrics: dict[str, Any], tokens: int, seconds: float) -> None:
    """`metrics` of a request of `tokens` generated tokens that took `seconds` at the client."""
    assert set(metrics) == METRICS, metrics
    ttft, generation, queue = metrics["time_to_first_token_ms"], metrics["generation_time_ms"], metrics["queue_time_ms"]
    assert 0 < ttft and 0 < generation and 0 <= queue
    assert queue + ttft + generation <= seconds * 1000
    assert metrics["mean_itl_ms"] == pytest.approx(generation / (tokens - 1))
    assert metrics["tokens_per_second"] == pytest.approx(tokens / ((ttft + generation) / 1000))


def test_per_request_metrics_on_a_whole_completion(http) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 5, "ignore_eos": True}
    started = time.monotonic()
    r = http.post("/v1/completions", json=body)
    seconds = time.monotonic() - started
    assert r.status_code == 200, r.text
    check_metrics(r.json()["metrics"], 5, seconds)
    # Several choices: which one would the figures be of? None is given, as in vLLM.
    r = http.post("/v1/completions", json={**body, "n": 2, "temperature": 1.0})
    assert r.status_code == 200 and "metrics" not in r.json()


def test_per_request_metrics_on_the_last_chunk_of_a_chat_stream(server: tuple[ServerProcess, Path]) -> None:
    body = {
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 4,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.monotonic()
    with (
        httpx.Client(base_url=server[0].base_url, timeout=60) as c,
        c.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200
        events = sse_events(r)
    seconds = time.monotonic() - started
    assert events[-1] == "[DONE]"
    *chunks, last = events[:-1]
    assert not any("metrics" in chunk for chunk in chunks)
    assert last["usage"]["completion_tokens"] == 4
    check_metrics(last["metrics"], 4, seconds)


def test_load_tracking_off_drops_the_route_and_says_why(http) -> None:
    r = http.get("/load")
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "server load tracking is off (--no-enable-server-load-tracking)"


def test_the_operator_flags_default_to_off_and_tracking_on() -> None:
    config = parse_serve_args([])
    assert (config.log_config_file, config.log_error_stack) == (None, False)
    assert config.enable_server_load_tracking is True
    assert config.engine.enable_logging_iteration_details is False
    assert config.enable_per_request_metrics is False
    assert parse_serve_args(["--enable-logging-iteration-details"]).engine.enable_logging_iteration_details


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "No such file or directory"),
        ("{not json", "invalid JSON: Expecting property name enclosed in double quotes at line 1"),
        ("[1, 2]", "expected a JSON object (a logging dictConfig)"),
    ],
)
def test_a_bad_log_config_file_stops_the_start(tmp_path: Path, capsys, content: str | None, expected: str) -> None:
    path = tmp_path / "logging.json"
    if content is not None:
        path.write_text(content)
    assert main(["--log-config-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"sonar serve: error: --log-config-file {path}: ") and expected in err, err
