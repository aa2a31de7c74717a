"""`sonar serve` options around requests: --generation-config / --override-generation-config,
--enable-tokenizer-info-endpoint, --enable-log-requests / --enable-log-outputs / --max-log-len and
--disable-access-log-for-endpoints, against real `python -m sonar serve` processes (whose stdout
and stderr the conftest helpers keep in files), plus the generation-config resolution on its own.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from sonar.cli.parse import parse_serve_args
from sonar.cli.serve import generation_defaults
from sonar.http.protocol import ChatCompletionRequest, CompletionRequest, decode_request
from tests.http.conftest import start_server, stop_server

BASE = ("--dtype", "float32", "--max-model-len", "256", "--num-gpu-blocks-override", "64", "--seed", "0")
PROMPT = "Tell me a long story about a lighthouse keeper and the sea"


@pytest.fixture(scope="module")
def options_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Everything on: a 3-token default, /tokenizer_info, request and output logs clipped to 12
    characters, no access log lines for /health and /metrics; and no /openapi.json."""
    srv = start_server(
        tmp_path_factory.mktemp("options"),
        *BASE,
        "--override-generation-config",
        '{"max_new_tokens": 3, "temperature": 0.0}',
        "--enable-tokenizer-info-endpoint",
        "--enable-log-requests",
        "--enable-log-outputs",
        "--max-log-len",
        "12",
        "--disable-access-log-for-endpoints",
        "/health,/metrics",
        "--disable-fastapi-docs",
    )
    yield srv
    assert stop_server(srv) == 0, srv.log()[-4000:]


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Defaults, except a --generation-config folder whose max_new_tokens is 5."""
    tmp = tmp_path_factory.mktemp("plain")
    folder = tmp / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 5, "temperature": 0.0}))
    srv = start_server(tmp, *BASE, "--generation-config", str(folder))
    yield srv
    assert stop_server(srv) == 0, srv.log()[-4000:]


def complete(server: Any, **body: Any) -> dict[str, Any]:
    r = httpx.post(
        f"{server.base_url}/v1/completions", json={"prompt": PROMPT, "ignore_eos": True, **body}, timeout=120
    )
    assert r.status_code == 200, r.text
    return r.json()


def chat(server: Any, **body: Any) -> dict[str, Any]:
    r = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": PROMPT}], "ignore_eos": True, **body},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def wait_for(server: Any, text: str, timeout: float = 10.0) -> str:
    """The server's stdout and stderr once `text` shows up in them (logs are written as they come)."""
    deadline = time.monotonic() + timeout
    while True:
        both = server.out() + server.log()
        if text in both or time.monotonic() > deadline:
            return both
        time.sleep(0.1)


# -- --generation-config / --override-generation-config --------------------------------------------
def test_override_max_new_tokens_is_the_default_max_tokens(options_server: Any) -> None:
    body = complete(options_server)
    assert body["usage"]["completion_tokens"] == 3
    assert body["choices"][0]["finish_reason"] == "length"
    assert chat(options_server)["usage"]["completion_tokens"] == 3


def test_max_new_tokens_caps_what_a_request_asks(options_server: Any) -> None:
    assert complete(options_server, max_tokens=10)["usage"]["completion_tokens"] == 3
    assert complete(options_server, max_tokens=2)["usage"]["completion_tokens"] == 2
    assert chat(options_server, max_completion_tokens=2)["usage"]["completion_tokens"] == 2


def test_override_temperature_makes_requests_greedy(options_server: Any) -> None:
    texts = {complete(options_server)["choices"][0]["text"] for _ in range(3)}
    assert len(texts) == 1


def test_generation_config_folder(plain_server: Any) -> None:
    assert complete(plain_server)["usage"]["completion_tokens"] == 5
    assert chat(plain_server)["usage"]["completion_tokens"] == 5
    assert "sampling defaults from the generation config: max_tokens=5, temperature=0.0" in plain_server.out()


def test_generation_defaults_resolution(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"max_new_tokens": 7, "top_k": 4, "top_p": 0.9, "do_sample": True, "bos_token_id": 1})
    )
    folder = str(tmp_path)
    assert generation_defaults(parse_serve_args(["--model", folder])) == {"max_tokens": 7, "top_k": 4, "top_p": 0.9}
    assert generation_defaults(parse_serve_args(["--generation-config", folder])) == {
        "max_tokens": 7,
        "top_k": 4,
        "top_p": 0.9,
    }
    merged = generation_defaults(
        parse_serve_args(["--model", folder, "--override-generation-config", '{"temperature": 0.5, "top_k": 2}'])
    )
    assert merged == {"max_tokens": 7, "top_k": 2, "top_p": 0.9, "temperature": 0.5}
    for mode in ("sonar", "vllm"):
        alone = parse_serve_args(
            ["--model", folder, "--generation-config", mode, "--override-generation-config", '{"min_p": 0.1}']
        )
        assert generation_defaults(alone) == {"min_p": 0.1}
    assert generation_defaults(parse_serve_args([])) == {}
    # a hub id is looked up in the local Hugging Face cache (never downloaded)
    cache = tmp_path / "hub"
    snapshot = cache / "models--someone--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (cache / "models--someone--tiny" / "refs").mkdir()
    (cache / "models--someone--tiny" / "refs" / "main").write_text("abc123")
    (snapshot / "config.json").write_text("{}")
    (snapshot / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95}))
    hub = parse_serve_args(["--model", "someone/tiny", "--download-dir", str(cache)])
    assert generation_defaults(hub) == {"temperature": 0.6, "top_p": 0.95}
    absent = parse_serve_args(["--model", "someone/absent", "--download-dir", str(cache)])
    assert generation_defaults(absent) == {}
    with pytest.raises(FileNotFoundError):
        generation_defaults(parse_serve_args(["--generation-config", str(tmp_path / "missing")]))


def test_request_fields_win_over_defaults() -> None:
    defaults = {"temperature": 0.3, "top_k": 5, "max_tokens": 6}
    req = decode_request(b'{"prompt": "x", "temperature": 0.9}', CompletionRequest)
    p = req.sampling_params(defaults)
    assert (p.temperature, p.top_k, p.max_tokens) == (0.9, 5, 6)
    assert decode_request(b'{"prompt": "x"}', CompletionRequest).sampling_params().max_tokens == 16
    assert (
        decode_request(b'{"prompt": "x", "max_tokens": null}', CompletionRequest).sampling_params().max_tokens is None
    )
    chat_req = decode_request(b'{"messages": [], "top_k": 9}', ChatCompletionRequest)
    p = chat_req.sampling_params(defaults)
    assert (p.temperature, p.top_k, p.max_tokens) == (0.3, 9, 6)


# -- /tokenizer_info ---------------------------------------------------------------------------------
def test_tokenizer_info_when_enabled(options_server: Any) -> None:
    r = httpx.get(f"{options_server.base_url}/tokenizer_info", timeout=30)
    assert r.status_code == 200
    info = r.json()
    assert info["tokenizer_class"]
    assert "<|im_start|>" in info["chat_template"]
    assert info["eos_token"] == "<|im_end|>"
    assert info["bos_token"] == "<|im_start|>"
    assert isinstance(info["model_max_length"], int)


def test_tokenizer_info_is_404_by_default(plain_server: Any) -> None:
    r = httpx.get(f"{plain_server.base_url}/tokenizer_info", timeout=30)
    assert r.status_code == 404
    assert r.json()["error"]["code"] == 404


# -- request logging, access log -------------------------------------------------------------------
def test_log_requests_and_outputs(options_server: Any) -> None:
    body = complete(options_server, max_tokens=3, temperature=0.0)
    rid = body["id"]
    both = wait_for(options_server, f"request_id={rid}")
    lines = [line for line in both.splitlines() if f"request_id={rid}" in line]
    received = [line for line in lines if "request.received" in line]
    output = [line for line in lines if "request.output" in line]
    assert len(received) == 1 and len(output) == 1, lines
    assert f"prompt={PROMPT[:12]!r}" in received[0]
    assert PROMPT[:13] not in received[0]
    assert '"max_tokens":3' in received[0] and '"temperature":0.0' in received[0]
    text = body["choices"][0]["text"]
    assert f"output={text[:12]!r}" in output[0]
    assert "finish_reason=length" in output[0] and "completion_tokens=3" in output[0]


def test_log_streamed_chat(options_server: Any) -> None:
    with httpx.stream(
        "POST",
        f"{options_server.base_url}/v1/chat/completions",
        timeout=120,
        json={"messages": [{"role": "user", "content": PROMPT}], "stream": True, "ignore_eos": True},
    ) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    rid = json.loads(lines[0][len("data: ") :])["id"]
    both = wait_for(options_server, f"request_id={rid}")
    mine = [line for line in both.splitlines() if f"request_id={rid}" in line]
    assert any("request.received" in line for line in mine), mine
    assert any("request.output" in line and "completion_tokens=3" in line for line in mine), mine
    deltas = [line for line in mine if "request.delta" in line]  # --enable-log-deltas is on by default
    assert len(deltas) == 3 and "finish_reason=length" in deltas[-1], mine


def test_no_request_log_by_default(plain_server: Any) -> None:
    complete(plain_server, max_tokens=2)
    assert "request.received" not in plain_server.log()
    assert "request.output" not in plain_server.log()


def test_access_log_leaves_out_the_listed_endpoints(options_server: Any) -> None:
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(options_server.base_url + path, timeout=30).status_code == 200
    both = wait_for(options_server, '"GET /version HTTP/1.1" 200')
    assert '"GET /version HTTP/1.1" 200' in both
    assert '"GET /health' not in both
    assert '"GET /metrics' not in both


def test_access_log_keeps_everything_by_default(plain_server: Any) -> None:
    assert httpx.get(plain_server.base_url + "/metrics", timeout=30).status_code == 200
    assert '"GET /metrics HTTP/1.1" 200' in wait_for(plain_server, '"GET /metrics HTTP/1.1" 200')


def test_openapi_schema_is_served_unless_disabled(options_server: Any, plain_server: Any) -> None:
    schema = httpx.get(f"{plain_server.base_url}/openapi.json", timeout=10)
    assert schema.status_code == 200 and "/v1/completions" in schema.json()["paths"]
    gone = httpx.get(f"{options_server.base_url}/openapi.json", timeout=10)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == 404
