"""`sonar serve -dp 2`: completions are served by two engine replicas, `/metrics` labels the engine
series per replica (``engine="0"``, ``engine="1"``) and names each replica's actors, `/actors`
shows both replicas' engines, a replica's worker killed mid-stream costs no request, and the
server stops cleanly."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Iterator

import httpx
import pytest

from tests.chaos.helpers import metrics
from tests.http.conftest import ServerProcess, start_server, stop_server_cleanly

PROMPTS = [
    "The capital of France is",
    "Two plus two equals",
    "My favourite animal is the",
    "Once upon a time, in a small village by the sea,",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server(
        tmp_path_factory.mktemp("replicas"),
        *("-dp", "2", "--dtype", "float32", "--max-model-len", "256", "--num-gpu-blocks-override", "64"),
        *("--served-model-name", "smol", "--seed", "0"),
    )
    yield srv
    stop_server_cleanly(srv)


def samples(base_url: str) -> dict[tuple[str, tuple], float]:
    return metrics(base_url, timeout=30)


def test_completions_are_served_and_both_replicas_show_in_metrics(server: ServerProcess) -> None:
    body = {"model": "smol", "prompt": PROMPTS, "max_tokens": 6, "temperature": 0}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == len(PROMPTS) and all(c["text"] and c["finish_reason"] for c in choices)
    again = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120).json()["choices"]
    assert [c["text"] for c in again] == [c["text"] for c in choices]  # greedy, on whichever replica

    m = samples(server.base_url)
    for engine in ("0", "1"):
        assert m[("sonar:prefix_cache_queries_total", (("engine", engine),))] > 0  # both served prompts
        assert m[("sonar:num_requests_running", (("engine", engine),))] == 0
        assert 0 <= m[("sonar:kv_cache_usage_perc", (("engine", engine),))] <= 1
        assert m[("sonar:actor_restarts_total", (("actor", f"replica{engine}/worker"),))] == 0
        assert ("sonar:actor_resident_memory_bytes", (("actor", f"replica{engine}/worker"),)) in m
    assert ("sonar:num_requests_running", ()) not in m
    assert m[("sonar:requests_tracked", (("actor", "scheduler"),))] == 0


def test_actors_shows_both_replicas_and_health_is_ok(server: ServerProcess) -> None:
    tree = httpx.get(f"{server.base_url}/actors", timeout=10).json()
    engine = next(c for c in tree["children"] if c["name"] == "engine")
    assert [c["name"] for c in engine["children"]] == ["replica0", "replica1"]
    workers = []
    for replica in engine["children"]:
        assert replica["kind"] == "supervisor" and replica["state"] == "running"
        assert {c["name"] for c in replica["children"]} == {"worker", "detokenizer", "scheduler"}
        workers += [c for c in replica["children"] if c["name"] == "worker"]
    assert all(w["placement"] == "process" for w in workers) and len({w["pid"] for w in workers}) == 2
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200


def test_the_startup_lines_say_how_many_replicas_serve(server: ServerProcess) -> None:
    out = server.out()
    assert "data parallel: 2 replicas, requests routed by prefix" in out
    assert "blocks of 16 tokens (1024 tokens) in each of 2 replicas" in out


def test_a_worker_killed_mid_stream_costs_no_request(server: ServerProcess) -> None:
    body = {"model": "smol", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    expected = {}
    for prompt in PROMPTS:
        r = httpx.post(f"{server.base_url}/v1/completions", json={**body, "prompt": prompt}, timeout=120)
        expected[prompt] = r.json()["choices"][0]["text"]
    tree = httpx.get(f"{server.base_url}/actors", timeout=10).json()
    engine = next(c for c in tree["children"] if c["name"] == "engine")
    victim = next(c for c in engine["children"][0]["children"] if c["name"] == "worker")

    results: dict[int, httpx.Response] = {}

    def one(i: int) -> None:
        payload = {**body, "prompt": PROMPTS[i % len(PROMPTS)]}
        results[i] = httpx.post(f"{server.base_url}/v1/completions", json=payload, timeout=120)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # both replicas are generating
        m = samples(server.base_url)
        if all(m.get(("sonar:num_requests_running", (("engine", e),)), 0) > 0 for e in ("0", "1")):
            break
        time.sleep(0.05)
    os.kill(victim["pid"], signal.SIGKILL)
    for t in threads:
        t.join(timeout=180)
    assert sorted(results) == list(range(8))
    for i, r in results.items():
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected[PROMPTS[i % len(PROMPTS)]]
    m = samples(server.base_url)
    assert m[("sonar:actor_restarts_total", (("actor", "replica0/worker"),))] == 1
    assert m[("sonar:actor_restarts_total", (("actor", "replica1/worker"),))] == 0
