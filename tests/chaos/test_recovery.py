"""A worker that dies, raises or hangs mid-stream costs the clients nothing: every stream ends
complete, with the text a run without the fault gives (the scheduler recomputes what was in
flight on the restarted worker), and the restart is counted.

The servers are real `python -m sonar serve` processes (`plain`, the package's, has no fault
injected); the worker runs in its own process (serve's default placement), so a SIGKILL takes
only the worker down."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.actors.helpers import alive
from tests.chaos.helpers import ENGINE_ARGS, PROMPTS, actor, metrics, stream_fleet
from tests.http.conftest import ServerProcess, serving

MAX_TOKENS = 24
#: The streams in flight when the fault comes, all decoding in one batch. More would lengthen the
#: prefill, whose time sets the worker's hang deadline, and every recompute, and check nothing new.
FLEET = PROMPTS[:16]


@pytest.fixture(scope="module")
def reference(plain: ServerProcess) -> list[str]:
    """The texts of the fleet's greedy streams when nothing goes wrong."""
    results = anyio.run(stream_fleet, plain.base_url, FLEET, MAX_TOKENS)
    for r in results:
        assert r.error is None and r.finish_reason == "length" and r.completion_tokens == MAX_TOKENS, r
    assert len(set(r.text for r in results)) > 1  # the prompts really differ
    return [r.text for r in results]


def check_complete(results: list[Any], reference: list[str]) -> None:
    for i, (r, expected) in enumerate(zip(results, reference)):
        assert r.error is None, f"stream {i} failed: {r.error}"
        assert r.finish_reason == "length" and r.completion_tokens == MAX_TOKENS, f"stream {i}: {r}"
        # no token lost or repeated across the restart: the streamed text is the reference text
        assert r.text == expected, f"stream {i} differs:\n{r.text!r}\n{expected!r}"


def restarts_metric(server: ServerProcess, name: str) -> float:
    return metrics(server.base_url)[("sonar:actor_restarts_total", (("actor", name),))]


def test_sigkill_of_the_worker_mid_stream_loses_nothing(plain: ServerProcess, reference: list[str]) -> None:
    before = actor(plain.base_url, "worker")
    pid = before["pid"]
    killed_at: list[int] = []

    async def kill_once(chunks: int) -> None:
        if chunks >= 4 * len(FLEET) and not killed_at:
            killed_at.append(chunks)
            os.kill(pid, signal.SIGKILL)

    results = anyio.run(stream_fleet, plain.base_url, FLEET, MAX_TOKENS, kill_once)
    assert killed_at and killed_at[0] < len(FLEET) * MAX_TOKENS  # the kill came mid-stream
    check_complete(results, reference)
    after = actor(plain.base_url, "worker")
    assert after["restarts"] == before["restarts"] + 1
    assert after["pid"] != pid and not alive(pid)
    assert restarts_metric(plain, "worker") == before["restarts"] + 1
    m = metrics(plain.base_url)
    assert m[("sonar:actor_resident_memory_bytes", (("actor", "worker"),))] > 100e6  # the new worker's weights
    assert m[("process_resident_memory_bytes", ())] > 100e6


@pytest.mark.parametrize("action", ["raise", "hang"])
def test_an_injected_fault_mid_stream_loses_nothing(action: str, reference: list[str], tmp_path: Path) -> None:
    # Step 1 is the prefill of the fleet's 16 prompts; step 12 is in the middle of their decoding.
    with serving(tmp_path, *ENGINE_ARGS, "--fault-injection", f"{action}@step=12", "--hang-margin", "2") as server:
        pid = actor(server.base_url, "worker")["pid"]
        results = anyio.run(stream_fleet, server.base_url, FLEET, MAX_TOKENS)
        check_complete(results, reference)
        worker = actor(server.base_url, "worker")
        assert worker["restarts"] == 1 and worker["pid"] != pid
        assert restarts_metric(server, "worker") == 1
        log = server.out() + server.log()
        assert "worker.fault_injected" in log
        if action == "hang":
            assert "worker.hung" in log  # the worker's own liveness deadline caught it
        else:
            assert "injected fault in the forward pass" in log
