"""The observability endpoints of a real `python -m sonar serve`: /metrics, /actors, /load.

The package's plain server (tests/http/conftest.py) serves the module. The counters are cumulative
over its life, so each test compares a scrape after its requests with one taken before them.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sonar.core.outputs import SchedulerStats
from sonar.http.metrics import stats_line
from tests.http.conftest import ServerProcess, sse_events

MODEL = "smol"
PROMPT = "Once upon a time, in a small village by the sea,"
MAX_TOKENS = 6

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def server(plain_server: ServerProcess) -> ServerProcess:
    return plain_server


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Any:
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def scrape(http: httpx.Client) -> Samples:
    r = http.get("/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    out: Samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_metrics_count_what_the_responses_reported(http: httpx.Client) -> None:
    before = scrape(http)
    base = {"model": MODEL, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
    chat = {**base, "messages": [{"role": "user", "content": "Tell me about the sea."}]}
    usages = []

    r = http.post("/v1/completions", json={**base, "prompt": PROMPT})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    usages.append(r.json()["usage"])
    r = http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    usages.append(r.json()["usage"])
    for path, body in (("/v1/completions", {**base, "prompt": PROMPT + " there"}), ("/v1/chat/completions", chat)):
        with http.stream("POST", path, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            events = [e for e in sse_events(r) if e != "[DONE]"]
        assert [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")] == ["length"]
        usages.append(events[-1]["usage"])
    requests = len(usages)

    after = scrape(http)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("sonar:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert (
        delta("sonar:generation_tokens_total") == sum(u["completion_tokens"] for u in usages) == requests * MAX_TOKENS
    )
    assert delta("sonar:request_success_total", finished_reason="length") == requests
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert delta(f"sonar:{hist}_count") == requests, hist
        assert delta(f"sonar:{hist}_sum") > 0, hist
    # Every token after a request's first follows an earlier one (a delta may carry several).
    assert 0 < delta("sonar:inter_token_latency_seconds_count") <= requests * (MAX_TOKENS - 1)
    assert value(after, "sonar:e2e_request_latency_seconds_bucket", le="+Inf") >= requests

    # Engine-side, from the scheduler's stats at scrape time: idle now.
    assert value(after, "sonar:num_requests_running") == 0
    assert value(after, "sonar:num_requests_waiting") == 0
    assert 0.0 <= value(after, "sonar:kv_cache_usage_perc") <= 1.0
    assert ("sonar:num_preemptions_total", frozenset()) in after
    queries, hits = value(after, "sonar:prefix_cache_queries_total"), value(after, "sonar:prefix_cache_hits_total")
    assert delta("sonar:prefix_cache_queries_total") > 0
    assert 0 <= hits <= queries
    # The same chat prompt twice: the second one finds full blocks of the first in the cache.
    assert delta("sonar:prefix_cache_hits_total") > 0

    for actor in ("worker", "detokenizer", "scheduler"):
        assert ("sonar:actor_restarts_total", frozenset({("actor", actor)})) in after, actor
        assert value(after, "sonar:actor_restarts_total", actor=actor) == 0
    assert ("sonar:actor_mailbox_depth", frozenset({("actor", "scheduler")})) in after


def test_actors_lists_the_live_tree(http: httpx.Client) -> None:
    r = http.get("/actors")
    assert r.status_code == 200, r.text
    tree = r.json()
    nodes: dict[str, dict[str, Any]] = {}

    def walk(node: dict[str, Any]) -> None:
        nodes[node["name"]] = node
        for child in node["children"]:
            walk(child)

    walk(tree)
    for name in ("worker", "detokenizer", "scheduler"):
        node = nodes[name]
        assert isinstance(node["pid"], int) and node["pid"] > 0, node
        assert node["restarts"] == 0, node
        assert node["state"] == "running", node


def test_load_counts_requests_in_flight(http: httpx.Client, server: ServerProcess) -> None:
    assert http.get("/load").json() == {"server_load": 0}
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as other:
        with other.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept: a closed line iterator would close the connection
            for line in lines:
                if line.startswith("data: "):
                    break
            assert http.get("/load").json() == {"server_load": 1}
            lines.close()
    # Hung up: the server aborts the request and the load drops back.
    deadline = time.monotonic() + 10
    while http.get("/load").json()["server_load"] != 0:
        assert time.monotonic() < deadline, "the load did not drop after the client hung up"
        time.sleep(0.05)
    deadline = time.monotonic() + 10
    while value(scrape(http), "sonar:request_success_total", finished_reason="abort") < 1:
        assert time.monotonic() < deadline, "the aborted request was not counted"
        time.sleep(0.05)


def test_stats_line_fields() -> None:
    stats = SchedulerStats(
        num_running=2,
        num_waiting=1,
        num_preemptions=0,
        kv_usage=0.125,
        num_free_blocks=84,
        prefix_queries=64,
        prefix_hits=16,
    )
    assert stats_line(stats, 12.34, 5.0, 0.25) == {
        "running": 2,
        "waiting": 1,
        "kv_cache_usage": "12.5%",
        "prompt_tokens_per_s": 12.3,
        "generation_tokens_per_s": 5.0,
        "prefix_cache_hit_rate": "25.0%",
    }
    assert stats_line(stats, 0.0, 0.0, None)["prefix_cache_hit_rate"] == "n/a"
    assert "mean_acceptance_length" not in stats_line(stats, 0.0, 0.0, None)
    assert stats_line(stats, 0.0, 0.0, None, 2.456)["mean_acceptance_length"] == 2.46  # speculating
    assert stats_line(stats, 0.0, 0.0, None, 0.0)["mean_acceptance_length"] == "n/a"  # no drafts


def test_per_request_metrics_follow_vllms_definitions() -> None:
    """Queued at 1.0, first scheduled at 1.5, first token at 2.0, the tenth and last at 3.0."""
    from sonar.core.outputs import RequestTiming
    from sonar.http.metrics import per_request_metrics

    metrics = per_request_metrics(RequestTiming(0.5, 0.5), first=2.0, last=3.0, tokens=10)
    assert metrics.queue_time_ms == pytest.approx(500.0)
    assert metrics.time_to_first_token_ms == pytest.approx(500.0)
    assert metrics.generation_time_ms == pytest.approx(1000.0)
    assert metrics.mean_itl_ms == pytest.approx(1000.0 / 9)
    assert metrics.tokens_per_second == pytest.approx(10 / 1.5)
    one = per_request_metrics(RequestTiming(0.5, 0.5), first=2.0, last=2.0, tokens=1)
    assert (one.mean_itl_ms, one.generation_time_ms, one.tokens_per_second) == (None, 0.0, pytest.approx(2.0))
    assert per_request_metrics(None, None, None, 0) == type(metrics)()
