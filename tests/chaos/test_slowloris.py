"""Slowloris against a real `python -m sonar serve`: 300 connections that send part of their
headers and then nothing (or keep trickling bytes) are all answered 408 and closed by the server
within --header-read-timeout, while a normal request is served as usual. Also here: /metrics with
--metrics-public answers without the API key (the other routes still need it).
"""

from __future__ import annotations

import json
import selectors
import socket
import time
from typing import Iterator

import httpx
import pytest

from tests.http.conftest import ServerProcess, start_server, stop_server

KEY = "sk-sonar-slowloris-8c2f"
AUTH = {"Authorization": f"Bearer {KEY}"}
HEADER_TIMEOUT = 2.0
CONNECTIONS = 300
#: How late after the header timeout a connection may be closed (a busy 2-core machine).
SLACK = 3.0
PARTIAL = b"POST /v1/completions HTTP/1.1\r\nHost: sonar\r\nContent-Type: application/json\r\nX-Slow: "


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server(
        tmp_path_factory.mktemp("slowloris"),
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--kv-cache-memory-bytes",
        "64M",
        "--seed",
        "0",
        "--api-key",
        KEY,
        "--metrics-public",
        "--header-read-timeout",
        str(HEADER_TIMEOUT),
        "--disable-uvicorn-access-log",
    )
    yield srv
    code = stop_server(srv)
    assert code == 0, f"the server exited with {code} on SIGTERM:\n{srv.log()[-4000:]}"
    assert "Traceback" not in srv.log(), srv.log()[-6000:]


def _address(server: ServerProcess) -> tuple[str, int]:
    host, port = server.base_url.removeprefix("http://").split(":")
    return host, int(port)


def _drain_until_closed(socks: list[socket.socket], deadline: float) -> dict[socket.socket, bytes]:
    """What each socket receives until the server closes it; fails if one is still open at `deadline`."""
    received = {s: b"" for s in socks}
    with selectors.DefaultSelector() as sel:
        for s in socks:
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ)
        open_ = set(socks)
        while open_:
            left = deadline - time.monotonic()
            assert left > 0, f"{len(open_)} of {len(socks)} connections still open"
            for key, _ in sel.select(timeout=left):
                s = key.fileobj
                try:
                    chunk = s.recv(65536)
                except ConnectionResetError:
                    chunk = b""
                if chunk:
                    received[s] += chunk
                else:
                    sel.unregister(s)
                    open_.discard(s)
    return received


def _assert_408(data: bytes) -> None:
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), data[:200]
    assert b"connection: close" in head.lower()
    assert "--header-read-timeout" in json.loads(body)["error"]["message"]


def test_partial_headers_are_closed_within_the_timeout(server: ServerProcess) -> None:
    socks = []
    try:
        for _ in range(CONNECTIONS):
            s = socket.create_connection(_address(server), timeout=10)
            s.sendall(PARTIAL)
            socks.append(s)
        opened = time.monotonic()
        # A normal request meanwhile: served, and long before the slow connections time out.
        r = httpx.post(
            f"{server.base_url}/v1/completions",
            headers=AUTH,
            timeout=30,
            json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
        )
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["text"], r.text
        received = _drain_until_closed(socks, opened + HEADER_TIMEOUT + SLACK)
        closed = time.monotonic() - opened
    finally:
        for s in socks:
            s.close()
    for data in received.values():
        _assert_408(data)
    assert closed > HEADER_TIMEOUT - 0.5, f"closed after {closed:.1f} s, before the timeout"
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200


def test_trickled_headers_do_not_extend_the_timeout(server: ServerProcess) -> None:
    """A byte every 0.3 s keeps a connection busy but not open: the deadline runs from its first byte."""
    with socket.create_connection(_address(server), timeout=10) as s:
        started = time.monotonic()
        s.sendall(PARTIAL)
        try:
            while time.monotonic() - started < HEADER_TIMEOUT + SLACK:
                s.sendall(b"x")
                time.sleep(0.3)
        except OSError:
            pass  # the server closed it
        received = _drain_until_closed([s], started + HEADER_TIMEOUT + SLACK)
    _assert_408(received[s])


def test_a_keep_alive_connection_gets_the_timeout_for_its_next_request(server: ServerProcess) -> None:
    with socket.create_connection(_address(server), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: sonar\r\n\r\n")
        first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 "), first
        started = time.monotonic()
        s.sendall(b"GET /health HTTP/1.1\r\nHost: sonar\r\n")  # the next request's headers, unfinished
        received = _drain_until_closed([s], started + HEADER_TIMEOUT + SLACK)
    _assert_408(received[s])
    assert time.monotonic() - started > HEADER_TIMEOUT - 0.5


def test_metrics_public_opens_only_metrics(server: ServerProcess) -> None:
    r = httpx.get(f"{server.base_url}/metrics", timeout=10)
    assert r.status_code == 200 and "sonar:num_requests_running" in r.text
    for path in ("/load", "/actors", "/v1/models", "/version"):
        assert httpx.get(f"{server.base_url}{path}", timeout=10).status_code == 401, path
    doc = httpx.get(f"{server.base_url}/openapi.json", headers=AUTH, timeout=10).json()
    assert "401" not in doc["paths"]["/metrics"]["get"]["responses"]
    assert "401" in doc["paths"]["/load"]["get"]["responses"]
