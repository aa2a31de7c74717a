"""The request limits and the API key against real `python -m sonar serve` processes, and the
engine-side limits through `sonar.open()`.

* With --api-key every route but /health, /ping and the web console's static page answers 401
  without the key (and works with it); /actors shows transport addresses only to a client with the key (without a key set: only
  to a loopback client).
* Each limit answers its status with an error naming its flag: 413 for a body over
  --max-request-body-bytes (a 16 MB body is refused before it is read: the server's resident
  memory grows by less than 100 MiB), 408 for a body slower than --body-read-timeout, 503 beyond
  --max-connections, 400 for the request limits (--max-prompt-chars, --max-stop-strings, ...),
  which the library raises as `InvalidRequestError` naming the parameter.
* A server listening beyond loopback without --api-key says so when it starts.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import anyio
import httpx
import msgspec
import pytest

import sonar
from sonar import InvalidRequestError, SamplingParams
from sonar.actors.tree import ActorInfo
from sonar.http.app import hide_addresses
from tests.http.conftest import ServerProcess, start_server, stop_server, stop_server_cleanly

MODEL = "smol"
KEY = "sk-sonar-limits-4b1d9e"
AUTH = {"Authorization": f"Bearer {KEY}"}
ENGINE = (
    "--dtype",
    "float32",
    "--max-model-len",
    "256",
    "--kv-cache-memory-bytes",
    "64M",
    "--seed",
    "0",
    "--served-model-name",
    MODEL,
)
LIMITS = {
    "--max-prompt-chars": 2000,
    "--max-stop-strings": 4,
    "--max-stop-string-chars": 32,
    "--max-stop-token-ids": 8,
    "--max-logit-bias": 8,
    "--max-chat-messages": 6,
    "--max-completions-per-request": 16,
}
MAX_CONNECTIONS = 12
BODY_TIMEOUT = 2.0
GOOD = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
SIXTEEN_MB = 16_000_000
#: A prompt of exactly --max-prompt-chars characters that is short in tokens (33).
LONGEST_PROMPT = " " * 1998 + "Hi"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    limits = [str(word) for item in LIMITS.items() for word in item]
    srv = start_server(
        tmp_path_factory.mktemp("limits"),
        *ENGINE,
        "--api-key",
        KEY,
        *limits,
        "--max-connections",
        str(MAX_CONNECTIONS),
        "--body-read-timeout",
        str(BODY_TIMEOUT),
    )
    yield srv
    stop_server_cleanly(srv)


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as c:
        yield c


def expect_error(r: httpx.Response, status: int, param: str | None = None, names: str | None = None) -> dict[str, Any]:
    """The OpenAI error of `r`: its status, the parameter it names, and the flag (`names`) its
    message names."""
    assert r.status_code == status, r.text[:500]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status, error
    if param is not None:
        assert error["param"] == param, error
    if names is not None:
        assert names in error["message"], error
    return error


# -- the API key --------------------------------------------------------------------------------
GUARDED = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", GOOD),
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/tokenize", {"prompt": "hello"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("GET", "/actors", None),
    ("GET", "/metrics", None),
    ("GET", "/load", None),
    ("GET", "/version", None),
    ("GET", "/openapi.json", None),
]


@pytest.mark.parametrize(("method", "path", "body"), GUARDED, ids=[g[1] for g in GUARDED])
def test_every_route_needs_the_key(server: ServerProcess, method: str, path: str, body: Any) -> None:
    with httpx.Client(base_url=server.base_url, timeout=60) as anonymous:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            expect_error(anonymous.request(method, path, json=body, headers=headers), 401)
        r = anonymous.request(method, path, json=body, headers=AUTH)
        assert r.status_code == 200, r.text[:500]


def test_probes_answer_without_the_key(server: ServerProcess) -> None:
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{server.base_url}/ping", timeout=10).status_code == 200
    assert httpx.post(f"{server.base_url}/ping", timeout=10).status_code == 200
    expect_error(httpx.get(f"{server.base_url}/no-such-route", timeout=10), 401)  # routes are not revealed either


def test_openapi_states_the_key_and_the_limits(http: httpx.Client) -> None:
    doc = http.get("/openapi.json").json()
    for path in ("/tokenize", "/detokenize", "/v1/completions"):
        op = doc["paths"][path]["post"]
        assert op["security"] == [{"bearer": []}] and "401" in op["responses"] and "413" in op["responses"]
    for path in ("/metrics", "/actors", "/load", "/version", "/v1/models"):
        assert "401" in doc["paths"][path]["get"]["responses"], path
    assert "401" not in doc["paths"]["/health"]["get"]["responses"]
    schemas = doc["components"]["schemas"]
    completion = schemas["CompletionRequest"]["properties"]
    stop = completion["stop"]["anyOf"]
    assert {"type": "string", "maxLength": 32} in stop
    assert {"type": "array", "items": {"type": "string", "maxLength": 32}, "maxItems": 4} in stop
    assert completion["stop_token_ids"]["anyOf"][0]["maxItems"] == 8
    assert completion["logit_bias"]["anyOf"][0]["maxProperties"] == 8
    assert {"type": "string", "maxLength": 2000} in completion["prompt"]["anyOf"]
    assert all(b.get("maxItems") == 16 for b in completion["prompt"]["anyOf"][1::2])
    assert {"type": "integer", "minimum": 1, "maximum": 16} in completion["n"]["anyOf"]
    assert schemas["ChatCompletionRequest"]["properties"]["messages"]["maxItems"] == 6


def test_actors_shows_addresses_only_with_the_key(server: ServerProcess, http: httpx.Client) -> None:
    expect_error(httpx.get(f"{server.base_url}/actors", timeout=10), 401)
    tree = http.get("/actors").json()
    assert tree["name"] == "sonar" and tree["children"]


def test_hidden_addresses() -> None:
    """What a client without the key sees of a tree with remote actors: no tcp/ipc address, in a
    placement or in an exit reason; the rest of the tree as it is."""
    remote = ActorInfo(
        "worker",
        "actor",
        "tcp://10.1.2.3:5555",
        4242,
        "running",
        1,
        0,
        1.0,
        last_exit="crash: host tcp://10.1.2.3:5555 unreachable",
    )
    ipc = ActorInfo("detokenizer", "actor", "ipc:///run/sonar/detok.sock", 77, "running", 0, 0, 1.0)
    local = ActorInfo("scheduler", "actor", "process", 78, "running", 0, 3, 1.0)
    tree = ActorInfo("engine", "supervisor", "inprocess", 1, "running", 0, None, 1.0, children=[remote, ipc, local])
    hidden = hide_addresses(tree)
    text = json.dumps(msgspec.to_builtins(hidden))
    for secret in ("10.1.2.3", "5555", "/run/sonar", "tcp://", "ipc://"):
        assert secret not in text, text
    assert [c.placement for c in hidden.children] == ["remote", "remote", "process"]
    assert hidden.children[0].last_exit == "crash: host <address> unreachable"
    assert [(c.name, c.pid, c.restarts, c.mailbox_depth) for c in hidden.children] == [
        ("worker", 4242, 1, 0),
        ("detokenizer", 77, 0, 0),
        ("scheduler", 78, 0, 3),
    ]


# -- the request limits over HTTP ---------------------------------------------------------------
OVER = [
    ("/v1/completions", {**GOOD, "stop": ["a", "b", "c", "d", "e"]}, "stop", "--max-stop-strings"),
    ("/v1/chat/completions", {**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop", "--max-stop-strings"),
    ("/v1/completions", {**GOOD, "stop": "x" * 33}, "stop", "--max-stop-string-chars"),
    ("/v1/chat/completions", {**CHAT, "stop": ["ok", "y" * 33]}, "stop", "--max-stop-string-chars"),
    ("/v1/completions", {**GOOD, "stop_token_ids": list(range(1, 10))}, "stop_token_ids", "--max-stop-token-ids"),
    ("/v1/chat/completions", {**CHAT, "stop_token_ids": list(range(1, 10))}, "stop_token_ids", "--max-stop-token-ids"),
    ("/v1/completions", {**GOOD, "logit_bias": {str(i): 1 for i in range(1, 10)}}, "logit_bias", "--max-logit-bias"),
    (
        "/v1/chat/completions",
        {**CHAT, "logit_bias": {str(i): 1 for i in range(1, 10)}},
        "logit_bias",
        "--max-logit-bias",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": "Hi"}] * 7},
        "messages",
        "--max-chat-messages",
    ),
    ("/tokenize", {"messages": [{"role": "user", "content": "Hi"}] * 7}, "messages", "--max-chat-messages"),
    ("/v1/completions", {**GOOD, "n": 17}, "n", "--max-completions-per-request"),
    ("/v1/chat/completions", {**CHAT, "n": 17}, "n", "--max-completions-per-request"),
    ("/v1/completions", {**GOOD, "prompt": ["Hi"] * 5, "n": 4}, "prompt", "--max-completions-per-request"),
    ("/v1/completions", {**GOOD, "prompt": [[1, 2]] * 17}, "prompt", "--max-completions-per-request"),
    ("/v1/completions", {**GOOD, "prompt": "a" * 2001}, "prompt", "--max-prompt-chars"),
    ("/v1/completions", {**GOOD, "prompt": ["Hi", "b" * 2001]}, "prompt", "--max-prompt-chars"),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": "c" * 2001}]},
        "messages",
        "--max-prompt-chars",
    ),
    ("/tokenize", {"prompt": "d" * 2001}, "prompt", "--max-prompt-chars"),
]


@pytest.mark.parametrize(
    ("path", "body", "param", "flag"), OVER, ids=[f"{o[0]}-{o[3]}-{i}" for i, o in enumerate(OVER)]
)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_each_request_limit_is_a_400_naming_its_flag(
    http: httpx.Client, path: str, body: dict[str, Any], param: str, flag: str, stream: bool
) -> None:
    if stream and path != "/tokenize":  # (/tokenize does not stream: it answers the same request again)
        body = {**body, "stream": True}
    expect_error(http.post(path, json=body), 400, param, flag)


def test_requests_at_the_limits_are_served(http: httpx.Client) -> None:
    at_limit = {
        "stop": ["x" * 32, "a", "b", "c"],
        "stop_token_ids": list(range(1, 9)),
        "logit_bias": {str(i): 0.5 for i in range(1, 9)},
    }
    r = http.post("/v1/completions", json={**GOOD, **at_limit, "prompt": ["Hi", LONGEST_PROMPT, "Yo", "Ok"], "n": 4})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 16
    r = http.post(
        "/v1/chat/completions", json={**CHAT, **at_limit, "messages": [{"role": "user", "content": "Hi"}] * 6}
    )
    assert r.status_code == 200, r.text
    r = http.post("/tokenize", json={"prompt": LONGEST_PROMPT})
    assert r.status_code == 200, r.text


# -- the body: size, read time ------------------------------------------------------------------
def _address(server: ServerProcess) -> tuple[str, int]:
    host, port = server.base_url.removeprefix("http://").split(":")
    return host, int(port)


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP response from `sock` (status, headers, body), read to its Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection before a whole response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection mid-response"
        body += chunk
    return int(lines[0].split()[1]), headers, body


def _resident_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_16_mb_body_is_refused_before_it_is_read(server: ServerProcess, http: httpx.Client) -> None:
    assert http.post("/tokenize", json={"prompt": "warm up"}).status_code == 200
    before = _resident_bytes(server.proc.pid)
    # Content-Length says 16 MB: the 413 comes back before a byte of the body is sent.
    with socket.create_connection(_address(server), timeout=10) as s:
        s.sendall(
            b"POST /tokenize HTTP/1.1\r\nHost: sonar\r\nAuthorization: Bearer %s\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (KEY.encode(), SIXTEEN_MB)
        )
        status, headers, body = _read_response(s)
    assert status == 413 and headers["connection"] == "close"
    assert "--max-request-body-bytes" in json.loads(body)["error"]["message"]

    # Chunked, no length: refused as soon as the bytes that arrived pass the limit, and the
    # connection is closed under the sender before it is through. The sender offers 64 MB: the
    # kernel alone can buffer tens of MB on loopback (tcp_rmem's autotuned receive buffer), which
    # a loaded machine's server may not drain before it answers.
    sent = 0
    offered = 4 * SIXTEEN_MB

    def pour(s: socket.socket) -> None:
        nonlocal sent
        piece = b"10000\r\n" + b"a" * 0x10000 + b"\r\n"
        try:
            s.sendall(b'10\r\n{"prompt": "aaaa\r\n')
            while sent < offered:
                s.sendall(piece)
                sent += 0x10000
        except OSError:
            pass  # the server closed the connection: the rest is never read

    with socket.create_connection(_address(server), timeout=30) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: sonar\r\nAuthorization: Bearer %s\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n" % KEY.encode()
        )
        writer = threading.Thread(target=pour, args=(s,))
        writer.start()
        status, headers, body = _read_response(s)
        writer.join(timeout=30)
    assert status == 413 and headers["connection"] == "close", body
    assert "--max-request-body-bytes" in json.loads(body)["error"]["message"]
    assert sent < offered
    grown = _resident_bytes(server.proc.pid) - before
    assert grown < 100 * 2**20, f"the server grew by {grown / 2**20:.0f} MiB"
    assert http.post("/v1/completions", json=GOOD).status_code == 200


def test_a_slow_body_gets_408(server: ServerProcess, http: httpx.Client) -> None:
    started = time.monotonic()
    with socket.create_connection(_address(server), timeout=BODY_TIMEOUT + 10) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: sonar\r\nAuthorization: Bearer %s\r\n"
            b'Content-Type: application/json\r\nContent-Length: 200\r\n\r\n{"prompt": ' % KEY.encode()
        )
        status, headers, body = _read_response(s)
    waited = time.monotonic() - started
    assert status == 408 and headers["connection"] == "close", body
    assert "--body-read-timeout" in json.loads(body)["error"]["message"]
    assert BODY_TIMEOUT - 0.5 < waited < BODY_TIMEOUT + 5, waited
    assert http.post("/v1/completions", json=GOOD).status_code == 200


def test_connections_beyond_the_cap_get_503(server: ServerProcess, http: httpx.Client) -> None:
    idle = [socket.create_connection(_address(server), timeout=10) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.5)  # accepted by the server
        r = httpx.get(f"{server.base_url}/v1/models", headers=AUTH, timeout=10)
        expect_error(r, 503, names="--max-connections")
        assert r.headers["connection"] == "close"
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 10
    while (r := httpx.get(f"{server.base_url}/v1/models", headers=AUTH, timeout=10)).status_code == 503:
        assert time.monotonic() < deadline, "the connections closed still count"
        time.sleep(0.1)
    assert r.status_code == 200, r.text


# -- a server without a key, on every interface ------------------------------------------------
def _outward_address() -> str:
    """An address of this machine that is not loopback: the one on its default route (a UDP
    connect sends no packet), else the one its host name resolves to."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("203.0.113.1", 9))
            address = s.getsockname()[0]
    except OSError:
        address = socket.gethostbyname(socket.gethostname())
    assert not address.startswith("127."), "this machine has no address but loopback"
    return address


def test_an_open_server_warns_and_shows_addresses_only_on_loopback(tmp_path: Path) -> None:
    srv = start_server(tmp_path, *ENGINE, "--host", "0.0.0.0")
    try:
        port = int(srv.base_url.rsplit(":", 1)[1])
        outward = f"http://{_outward_address()}:{port}"
        local = httpx.get(f"{srv.base_url}/actors", timeout=10).json()
        remote = httpx.get(f"{outward}/actors", timeout=10).json()
        assert remote == msgspec.to_builtins(hide_addresses(msgspec.convert(local, ActorInfo)))
        assert httpx.post(f"{outward}/tokenize", json={"prompt": "hi"}, timeout=10).status_code == 200
    finally:
        code = stop_server(srv)
    assert code == 0, srv.log()[-4000:]
    log = srv.out() + srv.log()
    assert "serve.unauthenticated" in log and "without --api-key" in log, log[-4000:]


def test_a_keyed_or_loopback_server_does_not_warn(server: ServerProcess) -> None:
    assert "serve.unauthenticated" not in server.out() + server.log()


# -- the same limits through the library --------------------------------------------------------
@pytest.mark.anyio
async def test_the_library_raises_typed_errors_naming_the_parameter(one_thread: None) -> None:
    limits = {flag.removeprefix("--").replace("-", "_"): value for flag, value in LIMITS.items()}
    async with sonar.open(dtype="float32", max_model_len=256, kv_cache_memory_bytes="64M", seed=0, **limits) as llm:
        cases = [
            (lambda: llm.generate("Hi", SamplingParams(stop=["a", "b", "c", "d", "e"])), "stop", "max_stop_strings"),
            (lambda: llm.generate("Hi", SamplingParams(stop="x" * 33)), "stop", "max_stop_string_chars"),
            (
                lambda: llm.generate("Hi", SamplingParams(stop_token_ids=list(range(1, 10)))),
                "stop_token_ids",
                "max_stop_token_ids",
            ),
            (
                lambda: llm.generate("Hi", SamplingParams(logit_bias={i: 1.0 for i in range(1, 10)})),
                "logit_bias",
                "max_logit_bias",
            ),
            (lambda: llm.generate("a" * 2001), "prompt", "max_prompt_chars"),
            (lambda: llm.generate("Hi", SamplingParams(n=17)), "n", "max_completions_per_request"),
            (lambda: llm.generate_many(["Hi"] * 5, SamplingParams(n=4)), "prompt", "max_completions_per_request"),
            (lambda: llm.chat([{"role": "user", "content": "Hi"}] * 7), "messages", "max_chat_messages"),
            (lambda: llm.chat([{"role": "user", "content": "c" * 2001}]), "messages", "max_prompt_chars"),
            (lambda: llm.tokenize("d" * 2001), "prompt", "max_prompt_chars"),
        ]
        for call, param, limit in cases:
            with anyio.fail_after(30):
                with pytest.raises(InvalidRequestError) as info:
                    await call()
            assert info.value.param == param and limit in str(info.value), (param, str(info.value))
        out = await llm.generate(
            "The capital of France is", SamplingParams(max_tokens=2, temperature=0, stop=["x" * 32, "a", "b", "c"])
        )
        assert out.finish_reason in ("length", "stop")


def test_limits_must_be_positive() -> None:
    from sonar.engine.config import LIMITS as NAMES
    from sonar.engine.config import EngineConfig

    for name in NAMES:
        with pytest.raises(ValueError, match=name):
            EngineConfig.from_args(**{name: 0})


def test_a_step_budget_below_the_running_sequences_is_refused_not_raised() -> None:
    """Each running sequence takes a token of every step, so a budget under `max_num_seqs` cannot
    be kept: given, it is refused naming both flags (it used to be raised silently); not given, it
    is 512 or `max_num_seqs`, whichever is larger."""
    from sonar.engine.config import EngineConfig

    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(16\) must be at least max_num_seqs \(256\)"):
        EngineConfig.from_args(max_num_batched_tokens=16)
    assert EngineConfig.from_args(max_num_batched_tokens=16, max_num_seqs=16).max_num_batched_tokens == 16
    assert EngineConfig.from_args().max_num_batched_tokens == 512
    assert EngineConfig.from_args(max_num_seqs=1024).max_num_batched_tokens == 1024
    assert EngineConfig.from_args(max_num_seqs=1024, max_num_batched_tokens=None).max_num_batched_tokens == 1024
