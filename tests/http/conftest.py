"""Start the real server (`python -m sonar serve`) as a subprocess for a test module.

The server serves the embedded SmolLM2-135M-Instruct in float32 with a small KV cache; its
stdout and stderr go to files under the module's temporary directory, so a failing test (or a
test that needs the server's log) can read them.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    base_url: str
    stdout: Path
    stderr: Path
    #: Seconds from starting the process to the first 200 from /health.
    startup_seconds: float = 0.0

    def log(self) -> str:
        return self.stderr.read_text(errors="replace")

    def out(self) -> str:
        return self.stdout.read_text(errors="replace")


@functools.cache
def tls() -> ssl.SSLContext:
    """One TLS context for clients a test makes by the hundred (``httpx.Client(verify=tls())``):
    httpx builds one per client otherwise, reading the CA bundle (~50 ms of CPU each)."""
    return ssl.create_default_context()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tmp: Path, *args: str, timeout: float = 120.0, env: Mapping[str, str] | None = None) -> ServerProcess:
    """Start `python -m sonar serve --port <free> *args` and wait for /health to answer 200;
    `env`: variables set for the server beside this process's."""
    port = free_port()
    out, err = tmp / "server.out", tmp / "server.err"
    # One intra-op thread: on a 2-vCPU machine two-thread OpenMP regions stall (see tests/engine).
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    started = time.monotonic()
    with out.open("wb") as fout, err.open("wb") as ferr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sonar", "serve", "--host", "127.0.0.1", "--port", str(port), *args],
            cwd=ROOT,
            env=environ,
            stdout=fout,
            stderr=ferr,
        )
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", out, err)
    deadline = started + timeout
    # One client for every probe: `httpx.get` builds an SSL context each call (~50 ms of CPU),
    # which over a start of many probes took CPU from the server being waited for.
    with httpx.Client(base_url=server.base_url, timeout=2, verify=tls()) as probe:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"the server exited with {proc.returncode}:\n{server.out()}\n{server.log()[-4000:]}")
            try:
                if probe.get("/health").status_code == 200:
                    server.startup_seconds = time.monotonic() - started
                    return server
            except httpx.TransportError:
                pass
            time.sleep(0.2)
    stop_server(server)
    pytest.fail(f"the server did not become healthy in {timeout} s:\n{server.log()[-4000:]}")


@contextmanager
def serving(tmp: Path, *args: str, env: Mapping[str, str] | None = None) -> Iterator[ServerProcess]:
    """A server for the length of the block; it must then stop on SIGTERM with exit code 0."""
    server = start_server(tmp, *args, env=env)
    yield server
    code = stop_server(server)
    assert code == 0, f"the server exited with {code} on SIGTERM:\n{server.log()[-4000:]}"


#: The flags of `plain_server`: float32, a small KV cache, greedy sampling seeded, prompt token
#: details in the usage, no cap on logprobs, and each request logged (its `user` too).
PLAIN_SERVER_ARGS = (
    *("--dtype", "float32", "--max-model-len", "256", "--num-gpu-blocks-override", "96", "--seed", "0"),
    *("--served-model-name", "smol", "--enable-prompt-tokens-details", "--max-logprobs", "-1"),
    *("--enable-log-requests", "--disable-uvicorn-access-log"),
)


@pytest.fixture(scope="package")
def plain_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server for the modules that need no other flags (test_admin, test_bench_payloads,
    test_cache_salt, test_metrics, test_pooling_server, test_request_fields): starting one costs
    seconds. Their tests change no server state that another reads: counters are compared before
    and after a test's own requests, prefix-cache hits asked of prompts no other test sends, log
    lines found by their own request ids or users, routes that answer 404. It must stop on SIGTERM
    with exit code 0, without logging a fault."""
    srv = start_server(tmp_path_factory.mktemp("plain"), *PLAIN_SERVER_ARGS)
    yield srv
    stop_server_cleanly(srv)


def sse_events(response: httpx.Response) -> list[Any]:
    """The `data:` payloads of an SSE response, JSON-decoded, `[DONE]` kept as the string."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def stop_server(server: ServerProcess) -> int:
    """SIGTERM, then wait for the orderly exit (SIGKILL after 30 s); the exit code."""
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()
    return server.proc.returncode


def stop_server_cleanly(server: ServerProcess) -> None:
    """Stop the server and assert it exited 0 on SIGTERM without logging a fault (a traceback or a
    request that failed with a 500): what a module of hostile requests must leave behind."""
    code = stop_server(server)
    assert code == 0, f"the server exited with {code} on SIGTERM:\n{server.log()[-4000:]}"
    for marker in ("Traceback", "request.failed"):
        assert marker not in server.log(), f"the server logged a fault:\n{server.log()[-6000:]}"
