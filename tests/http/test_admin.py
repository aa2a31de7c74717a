"""The operator's routes on a real server (`sonar/http/admin.py`): sleep mode and the profiler.

The server serves a tiny random-weight Llama with its worker in a process of its own, an API
key, sleep mode and the torch profiler; the package's `plain_server`, started without those flags,
answers their routes 404 naming the flag.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import torch

from tests.engine.conftest import save_word_tokenizer, spread_weights
from tests.http.conftest import ServerProcess, serving

KEY = "sleepy-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = {"model": "tiny", "prompt": "w5 w17 w300 w9", "max_tokens": 8, "temperature": 0}


def save_tiny_llama(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(3)
    model = LlamaForCausalLM(config).eval()
    spread_weights(model)
    model.save_pretrained(str(path))
    save_word_tokenizer(path, 512)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("traces") / "profiles"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny: Path, traces: Path) -> Iterator[ServerProcess]:
    args = (
        *(str(tiny), "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "256"),
        *("--num-gpu-blocks-override", "64", "--placement", "worker=process", "--api-key", KEY),
        "--enable-sleep-mode",
        *("--profiler-config.profiler", "torch", "--profiler-config.torch_profiler_dir", str(traces)),
    )
    with serving(tmp_path_factory.mktemp("admin"), *args) as srv:
        yield srv


@pytest.fixture
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as client:
        yield client


def complete(http: httpx.Client) -> list[Any]:
    response = http.post("/v1/completions", json=PROMPT)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_admin_routes_need_the_api_key(server: ServerProcess) -> None:
    for method, path in (("GET", "/is_sleeping"), ("POST", "/sleep"), ("POST", "/wake_up"), ("POST", "/start_profile")):
        response = httpx.request(method, server.base_url + path, timeout=30)
        assert response.status_code == 401, (path, response.text)


def test_sleep_refuses_requests_with_503_and_wake_up_restores_the_answer(http: httpx.Client) -> None:
    before = complete(http)
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}

    response = http.post("/sleep", params={"level": 1})
    assert response.status_code == 200, response.text
    assert response.json() == {"is_sleeping": True, "level": 1, "asleep": ["weights", "kv_cache"]}
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    refused = http.post("/v1/completions", json=PROMPT)
    assert refused.status_code == 503
    error = refused.json()["error"]
    assert error["type"] == "ServiceUnavailableError" and "asleep" in error["message"]
    assert http.post("/sleep", params={"level": 2}).status_code == 409  # asleep at level 1 already
    assert http.get("/health").status_code == 200  # asleep, not dead

    assert http.post("/wake_up").json() == {"is_sleeping": False, "level": 0, "asleep": []}
    assert complete(http) == before

    # level 2 reads the weights again from the checkpoint; waking tag by tag
    assert http.post("/sleep", params={"level": 2}).status_code == 200
    half = http.post("/wake_up", params={"tags": "weights"}).json()
    assert half == {"is_sleeping": True, "level": 2, "asleep": ["kv_cache"]}
    assert http.post("/v1/completions", json=PROMPT).status_code == 503
    assert http.post("/wake_up", params=[("tags", "kv_cache")]).json()["is_sleeping"] is False
    assert complete(http) == before


@pytest.mark.parametrize(
    ("path", "params", "message"),
    [
        ("/sleep", {"level": 3}, "sleep level must be 1 or 2"),
        ("/sleep", {"level": "deep"}, "level must be an integer"),
        ("/sleep", {"timeout": 0}, "drain timeout must be in"),
        ("/sleep", {"mode": "abort"}, "unknown query parameter 'mode'"),
        ("/wake_up", {"tags": "kv"}, "unknown wake-up tag 'kv'"),
    ],
)
def test_bad_admin_parameters_are_400(http: httpx.Client, path: str, params: dict[str, Any], message: str) -> None:
    response = http.post(path, params=params)
    assert response.status_code == 400 and message in response.json()["error"]["message"], response.text
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}


def load_trace(path: str) -> dict[str, Any]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def test_profile_writes_a_trace_of_the_forward_pass(http: httpx.Client, traces: Path) -> None:
    assert http.post("/start_profile").json() == {"profiling": True}
    complete(http)
    response = http.post("/stop_profile")
    assert response.status_code == 200, response.text
    files = response.json()["traces"]
    trace = next(f for f in files if ".pt.trace.json" in f)
    assert trace.endswith(".gz") and Path(trace).parent == traces  # torch_profiler_use_gzip: by default
    names = {event.get("name", "") for event in load_trace(trace)["traceEvents"]}
    assert any(name.startswith("aten::") for name in names)
    # the model's own forward pass, by its Python frames (torch_profiler_with_stack: by default)
    assert any("sonar/models/" in name and "forward" in name for name in names), sorted(names)[:50]
    table = next(f for f in files if f.endswith(".ops.txt"))
    assert "Self CPU" in Path(table).read_text()
    assert http.post("/stop_profile").json() == {"profiling": False, "traces": []}  # not running: nothing


def test_without_the_flags_the_routes_answer_404_naming_them(plain_server: ServerProcess) -> None:
    """The package's `plain_server` starts without any of the flags (a 404 changes nothing another
    module reads)."""
    with httpx.Client(base_url=plain_server.base_url, timeout=30) as http:
        for method, path, flag in (
            ("POST", "/sleep", "--enable-sleep-mode"),
            ("POST", "/wake_up", "--enable-sleep-mode"),
            ("GET", "/is_sleeping", "--enable-sleep-mode"),
            ("POST", "/start_profile", "--profiler-config"),
            ("POST", "/stop_profile", "--profiler-config"),
            ("POST", "/update_weights", "--weight-transfer-config"),
        ):
            response = http.request(method, path)
            assert response.status_code == 404, (path, response.text)
            assert flag in response.json()["error"]["message"]
        assert http.post("/v1/completions", json={"model": "smol", "prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_the_openapi_document_declares_the_routes_the_flags_turn_on() -> None:
    from sonar.http.openapi import Limits, build_openapi

    plain = build_openapi(Limits(max_model_len=16, max_logprobs=5, vocab_size=100))["paths"]
    assert not {"/sleep", "/wake_up", "/is_sleeping", "/start_profile", "/stop_profile"} & set(plain)
    doc = build_openapi(Limits(16, 5, 100, api_key=True, sleep_mode=True, profiling=True))["paths"]
    assert doc["/sleep"]["post"]["parameters"][0]["schema"]["enum"] == [1, 2]
    assert {"401", "409"} <= set(doc["/sleep"]["post"]["responses"])
    assert doc["/is_sleeping"]["get"]["security"] == [{"bearer": []}]
    assert {"/start_profile", "/stop_profile"} <= set(doc)


@pytest.mark.parametrize(
    ("client", "keys", "authenticated", "trusted"),
    [
        (("127.0.0.1", 5000), (), False, True),
        (("::1", 5000), (), False, True),
        (None, (), False, True),  # the Unix socket: its file permissions decide who connects
        (("192.0.2.7", 5000), (), False, False),
        (("a-host-name", 5000), (), False, False),
        (("192.0.2.7", 5000), (KEY,), True, True),
        (("127.0.0.1", 5000), (KEY,), False, False),
    ],
)
def test_without_an_api_key_only_this_machine_may_change_the_engine(
    client: tuple[str, int] | None, keys: tuple[str, ...], authenticated: bool, trusted: bool
) -> None:
    """The rule the admin routes that change the engine (and /actors' addresses) apply to the
    connection's ASGI scope; the servers above show it through HTTP for the loopback client and
    the key."""
    from sonar.http.admin import trusted_client

    scope = {"type": "http", "client": client, "state": {"authenticated": authenticated}}
    assert trusted_client(scope, keys) is trusted
