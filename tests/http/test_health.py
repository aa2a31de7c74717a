"""`/health` is honest from the first second: the frontend listens before the engine has loaded
and says 503 (and so does every other route, with an OpenAI error) until the engine answers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.http.conftest import ROOT, ServerProcess, free_port


def test_health_is_503_while_the_engine_starts_then_200(tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    with (tmp_path / "out").open("wb") as out, (tmp_path / "err").open("wb") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sonar",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--dtype",
                "float32",
                "--max-model-len",
                "256",
                "--num-gpu-blocks-override",
                "64",
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=err,
        )
    # One client for every probe: `httpx.get` builds an SSL context each call (~50 ms of CPU),
    # which at this rate took most of a core from the server being watched.
    try:
        with httpx.Client(base_url=base, timeout=5) as probe:
            statuses: list[int] = []
            starting_error = None
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    status = probe.get("/health").status_code
                except httpx.TransportError:
                    time.sleep(0.05)
                    continue
                statuses.append(status)
                if status == 503 and starting_error is None:
                    r = probe.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                    starting_error = (r.status_code, r.json())
                if status == 200:
                    break
                time.sleep(0.05)
            assert statuses and statuses[-1] == 200, (tmp_path / "err").read_text()[-3000:]
            assert statuses[0] == 503  # the port answered before the engine was ready
            assert set(statuses[:-1]) == {503}
            status, body = starting_error  # type: ignore[misc]
            assert status == 503 and body["error"]["type"] == "ServiceUnavailableError"
            assert "starting" in body["error"]["message"]
            r = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def test_the_server_and_its_worker_process_each_settle_their_heap_once(plain_server: ServerProcess) -> None:
    """Each process a start builds collects its garbage once and freezes what survives
    (`sonar.heap`): serve's own before the first request, the worker's once the model is loaded."""
    settled = [line for line in plain_server.log().splitlines() if "heap.settled" in line]
    pids = [int(re.search(r"pid=(\d+)", line).group(1)) for line in settled]
    frozen = [int(re.search(r"frozen=(\d+)", line).group(1)) for line in settled]
    assert len(pids) == len(set(pids)) == 2 and plain_server.proc.pid in pids, settled
    assert min(frozen) > 10_000  # each holds at least torch's modules
