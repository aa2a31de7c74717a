"""Shutdown and request-shape behaviours of a real `python -m sonar serve` subprocess.

Two servers: one on a Unix domain socket with the response extras switched on (prompt token
details, request id headers, a custom fingerprint, --stream-interval, token ids as logprob tokens,
a CORS origin list) and `--shutdown-timeout 0`, which the last test stops under load; and one on
TCP with `--shutdown-timeout 10` and the worker in a child process, which drains under load.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from sonar.cli.parse import parse_serve_args
from sonar.cli.serve import system_fingerprint
from tests.actors.helpers import alive
from tests.http.conftest import ROOT, ServerProcess, sse_events, start_server, stop_server

COMMON = (
    "--dtype",
    "float32",
    "--max-model-len",
    "256",
    "--num-gpu-blocks-override",
    "96",
    "--seed",
    "0",
    "--served-model-name",
    "smol",
)
ORIGIN = "https://ok.example"
FINGERPRINT = "fp-lifecycle-test"
STORY = "Once upon a time, in a small village by the sea,"
# Long enough for several 16-token prefix-cache blocks, and used by no other test of this server.
LONG_PROMPT = (
    "A lighthouse keeper kept a logbook of every ship that passed the rocky cape: the date, "
    "the flag, the weather, the direction of the wind and the colour of the sails. After "
    "forty years the logbooks filled a whole wall of the tower, and historians came"
)


# -- helpers --------------------------------------------------------------------------------------
def child_pids(pid: int) -> set[int]:
    """The live descendants of `pid` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if fields[0] != "Z":
                parents[int(entry)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {c for c, p in parents.items() if p in frontier} - found
        found |= frontier
    return found


def start_uds_server(tmp: Path, sock: Path, *args: str, timeout: float = 120.0) -> tuple[subprocess.Popen, Path]:
    """`python -m sonar serve --uds <sock> *args`, healthy; returns the process and its log file."""
    log = tmp / "server.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    with log.open("wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sonar", "serve", "--uds", str(sock), *args],
            cwd=ROOT,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        if sock.exists():
            try:
                with uds_client(sock) as c:
                    if c.get("/health", timeout=2).status_code == 200:
                        return proc, log
            except httpx.TransportError:
                pass
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"the server did not become healthy in {timeout} s:\n{log.read_text()[-4000:]}")


def uds_client(sock: Path) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://sonar", timeout=60)


class StreamInBackground:
    """A streamed completion read on a thread; `started` is set at its first content event."""

    def __init__(self, client_factory: Any, body: dict[str, Any], path: str = "/v1/completions") -> None:
        self.events: list[Any] = []
        self.status: int | None = None
        self.error: BaseException | None = None
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(client_factory, path, body), daemon=True)
        self.thread.start()

    def _run(self, client_factory: Any, path: str, body: dict[str, Any]) -> None:
        try:
            with client_factory() as c, c.stream("POST", path, json={**body, "stream": True}) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[len("data: ") :]
                        self.events.append(data if data == "[DONE]" else json.loads(data))
                        self.started.set()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
        finally:
            self.started.set()

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stream did not end"
        assert self.error is None, repr(self.error)
        assert self.status == 200

    def finish_reasons(self) -> list[str]:
        return [
            c["finish_reason"]
            for e in self.events
            if isinstance(e, dict)
            for c in e.get("choices", [])
            if c.get("finish_reason")
        ]


# -- the UDS server with the extras ------------------------------------------------------------------
@pytest.fixture(scope="module")
def uds_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("uds")
    sock = tmp / "sonar.sock"
    proc, log = start_uds_server(
        tmp,
        sock,
        *COMMON,
        "--shutdown-timeout",
        "0",
        "--enable-prompt-tokens-details",
        "--enable-request-id-headers",
        "--fingerprint-mode",
        "custom",
        "--fingerprint-value",
        FINGERPRINT,
        "--stream-interval",
        "4",
        "--return-tokens-as-token-ids",
        "--allowed-origins",
        ORIGIN,
    )
    yield proc, sock, log
    if proc.poll() is None:  # the abort test did not get to stop it
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def uds(uds_server: Any) -> Any:
    with uds_client(uds_server[1]) as c:
        yield c


def test_serves_on_a_unix_socket_with_the_fingerprint_and_request_ids(uds: httpx.Client) -> None:
    r = uds.post("/v1/completions", json={"model": "smol", "prompt": STORY, "max_tokens": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["system_fingerprint"] == FINGERPRINT
    assert body["usage"]["completion_tokens"] == 3
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
    # The client's own id is echoed, on every route.
    r = uds.get("/v1/models", headers={"X-Request-Id": "my-id-42"})
    assert r.headers["x-request-id"] == "my-id-42"
    r = uds.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert r.json()["system_fingerprint"] == FINGERPRINT and "x-request-id" in r.headers


def test_cors_preflight_follows_allowed_origins(uds: httpx.Client) -> None:
    asked = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    ok = uds.options("/v1/completions", headers={"Origin": ORIGIN, **asked})
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in ok.headers["access-control-allow-methods"]
    denied = uds.options("/v1/completions", headers={"Origin": "https://evil.example", **asked})
    assert denied.status_code == 400
    assert "access-control-allow-origin" not in denied.headers
    # A simple cross-origin request from an allowed origin gets the header; others do not.
    assert uds.get("/health", headers={"Origin": ORIGIN}).headers["access-control-allow-origin"] == ORIGIN
    assert "access-control-allow-origin" not in uds.get("/health", headers={"Origin": "https://evil.example"}).headers


def test_repeated_long_prompt_reports_cached_prompt_tokens(uds: httpx.Client) -> None:
    first = uds.post("/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 1}).json()["usage"]
    assert first["prompt_tokens"] > 48
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    second = uds.post("/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 1}).json()["usage"]
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert 32 <= cached < second["prompt_tokens"] and cached % 16 == 0, second
    # Chat and a streamed usage chunk report it too.
    messages = [{"role": "user", "content": LONG_PROMPT}]
    uds.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    chat = uds.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()["usage"]
    assert chat["prompt_tokens_details"]["cached_tokens"] >= 32
    with uds.stream(
        "POST",
        "/v1/completions",
        json={"prompt": LONG_PROMPT, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}},
    ) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32


def test_stream_interval_batches_tokens_and_logprob_tokens_are_ids(uds: httpx.Client) -> None:
    body = {"prompt": STORY, "max_tokens": 10, "ignore_eos": True, "logprobs": 1, "stream": True, "temperature": 0}
    with uds.stream("POST", "/v1/completions", json=body) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [e["choices"][0] for e in events[:-1]]
    # the first token at once, then four at a time (decoded four per step: multi-step decode)
    assert [len(c["logprobs"]["tokens"]) for c in chunks] == [1, 4, 4, 1]
    assert chunks[-1]["finish_reason"] == "length"
    assert {e["system_fingerprint"] for e in events[:-1]} == {FINGERPRINT}
    tokens = [t for c in chunks for t in c["logprobs"]["tokens"]]
    assert all(re.fullmatch(r"token_id:\d+", t) for t in tokens), tokens
    for c in chunks:
        for top in c["logprobs"]["top_logprobs"]:
            assert all(k.startswith("token_id:") for k in top)
    # The same ids as the whole (non-streamed) greedy completion.
    whole = uds.post("/v1/completions", json={**body, "stream": False}).json()["choices"][0]
    assert whole["logprobs"]["tokens"] == tokens
    assert "".join(c["text"] for c in chunks) == whole["text"]
    # Chat: content tokens and alternatives as ids too.
    chat = uds.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "logprobs": True, "top_logprobs": 2},
    ).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert content and all(re.fullmatch(r"token_id:\d+", p["token"]) for p in content)
    assert all(t["token"].startswith("token_id:") for p in content for t in p["top_logprobs"])


def test_fingerprint_modes() -> None:
    def fp(*args: str) -> str | None:
        return system_fingerprint(parse_serve_args(list(args)))

    full, hashed = fp(), fp("--fingerprint-mode", "hash")
    assert re.fullmatch(r"sonar-[^-]+-[0-9a-f]{8}", full or ""), full
    assert hashed == full  # Sonar runs no parallelism, so full has no degrees to add
    assert fp("--max-model-len", "128") != full  # the hash follows the configuration
    assert fp("--fingerprint-mode", "custom", "--fingerprint-value", "abc") == "abc"
    assert fp("--fingerprint-mode", "none") is None


def test_zero_shutdown_timeout_aborts_in_flight_requests_at_once(uds_server: Any) -> None:
    proc, sock, log = uds_server
    body = {"prompt": STORY, "max_tokens": 200, "ignore_eos": True}
    whole: dict[str, Any] = {}

    def post_whole() -> None:
        with uds_client(sock) as c:
            whole["response"] = c.post("/v1/completions", json=body)

    poster = threading.Thread(target=post_whole, daemon=True)
    poster.start()
    time.sleep(0.3)  # the whole request goes first: it is running by the time the streams have output
    streams = [
        StreamInBackground(lambda: uds_client(sock), body),
        StreamInBackground(
            lambda: uds_client(sock),
            {"messages": [{"role": "user", "content": STORY}], "max_tokens": 200, "ignore_eos": True},
            "/v1/chat/completions",
        ),
    ]
    for s in streams:
        assert s.started.wait(30)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=10)
    took = time.monotonic() - sent
    assert code == 0, log.read_text()[-4000:]
    assert took < 2.0, f"exit took {took:.2f} s:\n{log.read_text()[-3000:]}"
    for s in streams:
        s.join(5)
        assert s.finish_reasons() == ["abort"], s.events[-3:]
        assert s.events[-1] == "[DONE]"
    poster.join(5)
    r = whole["response"]
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "abort" and r.json()["usage"]["completion_tokens"] < 200
    assert not sock.exists()
    assert "aborted 3 request(s)" in log.read_text()


# -- the TCP server that drains ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def draining_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    srv = start_server(
        tmp_path_factory.mktemp("drain"), *COMMON, "--shutdown-timeout", "10", "--placement", "worker=process"
    )
    yield srv
    stop_server(srv)


def test_sigterm_drains_in_flight_requests_then_exits_0(draining_server: ServerProcess) -> None:
    srv = draining_server
    children = child_pids(srv.proc.pid)
    assert children, "the worker runs in a child process"
    body = {"prompt": STORY, "max_tokens": 32, "ignore_eos": True}  # a few seconds on a loaded 2-CPU VM
    streams = [StreamInBackground(lambda: httpx.Client(base_url=srv.base_url, timeout=60), body) for _ in range(3)]
    for s in streams:
        assert s.started.wait(30)
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    # Draining: the server still listens (the streams run for seconds) but takes no new work.
    r = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=10)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["type"] == "ServiceUnavailableError"
    assert httpx.get(srv.base_url + "/health", timeout=10).status_code == 503
    for s in streams:
        s.join(30)
        assert s.finish_reasons() == ["length"], s.events[-3:]
        assert s.events[-1] == "[DONE]"
    streams_done = time.monotonic()
    code = srv.proc.wait(timeout=20)
    # It exits once the last request is done, not when the 10 s are up.
    assert time.monotonic() - streams_done < 3.0
    assert code == 0, srv.log()[-4000:]
    assert "sonar serve: stopped" in srv.out()
    deadline = time.monotonic() + 5
    while any(alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in children if alive(p)], "child processes outlived the server"
