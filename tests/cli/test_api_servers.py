"""`sonar serve --api-server-count 2` on the embedded model: two API server processes share the
port over one engine. Concurrent requests land on both (each response names its server in
``x-sonar-api-server``) with the greedy text of `--api-server-count 1`; every route answers the
same on both; `/metrics` and `/load` count the requests of both, whichever answers; a client that
hangs up on the second server aborts its request in the engine; killing the second server's
process loses no request of the first, and it is restarted; SIGTERM ends the requests in flight on
both with finish_reason "abort" and stops every process.

Three servers: the shared `-asc 2` server (its tests run in file order: the checks that leave it as
they found it, then the SIGKILL of ``api1``, then SIGTERM, which stops it), the reference (`-asc
1`) and one whose engine gives up. The last two run the worker in the `serve` process: one process
less to start, and each restart of the worker that gives up is then a model load, not a process
start. (Started at once, the three took longer than one after the other on two busy cores.)"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.http.conftest import ServerProcess, sse_events, start_server, stop_server

pytestmark = pytest.mark.slow  # three server starts

HEADER = "x-sonar-api-server"
ARGS = (
    *("--dtype", "float32", "--max-model-len", "256", "--num-gpu-blocks-override", "64", "--seed", "0"),
    *("--served-model-name", "smol", "--max-stored-responses", "0", "--disable-uvicorn-access-log"),
)
PROMPTS = ["The capital of France is", "Two plus two equals", "My favourite animal is the", "Once upon a time,"]
COMPLETION = {"model": "smol", "max_tokens": 12, "temperature": 0}
LONG = {"model": "smol", "prompt": "Once upon a time, in a small village by the sea,", "max_tokens": 230}
GIVES_UP = ("--fault-injection", "raise@p=1", "--placement", "worker=inprocess")


def chat(prompt: str) -> dict[str, Any]:
    return {**COMPLETION, "messages": [{"role": "user", "content": prompt}]}


def greedy_texts(base_url: str) -> dict[tuple[str, str], str]:
    """Each prompt's greedy completion and chat answer."""
    out = {}
    for prompt in PROMPTS:
        r = httpx.post(f"{base_url}/v1/completions", json={**COMPLETION, "prompt": prompt}, timeout=120)
        out["completion", prompt] = r.json()["choices"][0]["text"]
        r = httpx.post(f"{base_url}/v1/chat/completions", json=chat(prompt), timeout=120)
        out["chat", prompt] = r.json()["choices"][0]["message"]["content"]
    return out


@pytest.fixture(scope="module")
def expected(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], str]:
    """The greedy texts of one API server (`--api-server-count 1`)."""
    server = start_server(tmp_path_factory.mktemp("asc1"), *ARGS, "--placement", "worker=inprocess")
    try:
        return greedy_texts(server.base_url)
    finally:
        assert stop_server(server) == 0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server(tmp_path_factory.mktemp("asc2"), "--api-server-count", "2", *ARGS)
    wait_for_second_server(srv)
    yield srv
    stop_server(srv)


def wait_for_second_server(server: ServerProcess, timeout: float = 90.0) -> int:
    """Until the second API server runs and answers; its pid."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        node = api1(server.base_url)
        if node is not None and node["state"] == "running" and on_server(1, lambda: get(server, "/health")):
            return node["pid"]
        time.sleep(0.2)
    pytest.fail(f"the second API server did not serve in {timeout} s:\n{server.log()[-4000:]}")


def api1(base_url: str) -> dict[str, Any] | None:
    """The second API server's node in `/actors`."""
    tree = httpx.get(f"{base_url}/actors", timeout=10).json()
    servers = next((c for c in tree["children"] if c["name"] == "api-servers"), None)
    return None if servers is None else next(c for c in servers["children"] if c["name"] == "api1")


def get(server: ServerProcess, path: str) -> httpx.Response:
    return httpx.get(f"{server.base_url}{path}", timeout=30)


def on_server(index: int, call: Callable[[], httpx.Response], tries: int = 200) -> httpx.Response | None:
    """`call` (a new connection each time) until API server `index` answers it; its response."""
    for _ in range(tries):
        r = call()
        if r.headers.get(HEADER) == str(index):
            return r
    return None


def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def scrape(server: ServerProcess, index: int) -> str:
    """`/metrics` as API server `index` answers it."""
    r = on_server(index, lambda: get(server, "/metrics"))
    assert r is not None, f"API server {index} did not answer /metrics"
    return r.text


def load(server: ServerProcess, index: int) -> int:
    r = on_server(index, lambda: get(server, "/load"))
    assert r is not None, f"API server {index} did not answer /load"
    return r.json()["server_load"]


def client_on(server: ServerProcess, index: int) -> httpx.Client:
    """A client whose connection API server `index` accepted (its requests all go there)."""
    for _ in range(200):
        client = httpx.Client(base_url=server.base_url, timeout=60)
        if client.get("/health").headers.get(HEADER) == str(index):
            return client
        client.close()
    pytest.fail(f"no connection reached API server {index}")


def http_counts(text: str) -> dict[str, float]:
    """The per-request counters of a scrape (what the API servers record, not the engine)."""
    m = samples(text)
    return {
        "requests": sum(v for (name, _), v in m.items() if name == "sonar:request_success_total"),
        "prompt_tokens": m[("sonar:prompt_tokens_total", ())],
        "generation_tokens": m[("sonar:generation_tokens_total", ())],
        **{
            name: m[(f"sonar:{name}_count", ())]
            for name in (
                "e2e_request_latency_seconds",
                "time_to_first_token_seconds",
                "request_queue_time_seconds",
            )
        },
    }


def test_the_startup_lines_say_how_many_api_servers_serve(server) -> None:
    assert "API servers: 2 processes sharing the port (SO_REUSEPORT) over one engine" in server.out()


def test_concurrent_requests_land_on_both_servers_with_the_greedy_text_of_one(server, expected) -> None:
    jobs = [(kind, prompt) for kind in ("completion", "chat") for prompt in PROMPTS] * 3
    results: dict[int, httpx.Response] = {}

    def one(i: int) -> None:
        kind, prompt = jobs[i]
        if kind == "completion":
            results[i] = httpx.post(
                f"{server.base_url}/v1/completions", json={**COMPLETION, "prompt": prompt}, timeout=120
            )
        else:
            results[i] = httpx.post(f"{server.base_url}/v1/chat/completions", json=chat(prompt), timeout=120)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert sorted(results) == list(range(len(jobs)))
    served_by = set()
    for i, r in results.items():
        assert r.status_code == 200, r.text
        served_by.add(r.headers[HEADER])
        choice = r.json()["choices"][0]
        text = choice["text"] if jobs[i][0] == "completion" else choice["message"]["content"]
        assert text == expected[jobs[i]]
    assert served_by == {"0", "1"}


def test_streaming_and_every_route_answer_the_same_on_both(server, expected) -> None:
    for index in (0, 1):
        body = {**COMPLETION, "prompt": PROMPTS[0], "stream": True}

        def stream() -> httpx.Response:
            with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=120) as r:
                r.read()
                return r

        r = on_server(index, stream)
        assert r is not None and r.status_code == 200
        events = sse_events(r)
        assert events[-1] == "[DONE]"
        assert (
            "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == expected["completion", PROMPTS[0]]
        )

        models = on_server(index, lambda: get(server, "/v1/models"))
        assert models is not None and [m["id"] for m in models.json()["data"]] == ["smol"]
        health = on_server(index, lambda: get(server, "/health"))
        assert health is not None and health.status_code == 200
        actors = on_server(index, lambda: get(server, "/actors"))
        assert actors is not None
        assert [c["name"] for c in actors.json()["children"]] == ["frontend", "engine", "api-servers"]
        metrics = on_server(index, lambda: get(server, "/metrics"))
        assert metrics is not None
        m = samples(metrics.text)
        assert m[("sonar:num_requests_running", ())] == 0  # the engine's numbers, from either server
        assert m[("sonar:actor_restarts_total", (("actor", "worker"),))] == 0
        assert ("sonar:kv_cache_usage_perc", ()) in m


def test_a_client_hanging_up_on_the_second_server_aborts_its_request(server) -> None:
    body = {**LONG, "stream": True, "ignore_eos": True}
    for _ in range(200):
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as r:
            if r.headers.get(HEADER) != "1":
                continue  # on the first server: hung up at once, retried
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break
            break
    else:
        pytest.fail("no streamed request reached the second API server")
    deadline = time.monotonic() + 10
    while True:
        engine = samples(get(server, "/metrics").text)
        if engine[("sonar:num_requests_running", ())] == 0 and engine[("sonar:kv_cache_usage_perc", ())] == 0:
            break
        assert time.monotonic() < deadline, "the request still runs in the engine after its client left"
        time.sleep(0.1)
    second = on_server(1, lambda: get(server, "/metrics"))
    assert second is not None
    assert samples(second.text)[("sonar:request_success_total", (("finished_reason", "abort"),))] >= 1


def test_metrics_and_load_count_the_requests_of_both_servers_whichever_answers(server) -> None:
    """The per-request series are summed over the API servers (prometheus_client's multiprocess
    files in the directory the `serve` process shares with them); the engine's appear once."""
    before = [http_counts(scrape(server, index)) for index in (0, 1)]
    assert before[0] == before[1]
    served = {"0": 0, "1": 0}
    prompt_tokens = generation_tokens = 0
    for _ in range(200):  # a new connection each: the kernel picks the server
        body = {**COMPLETION, "prompt": PROMPTS[sum(served.values()) % len(PROMPTS)]}
        r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        served[r.headers[HEADER]] += 1
        prompt_tokens += r.json()["usage"]["prompt_tokens"]
        generation_tokens += r.json()["usage"]["completion_tokens"]
        if min(served.values()) >= 3:
            break
    assert min(served.values()) >= 3, f"the requests did not land on both servers: {served}"
    sent = sum(served.values())
    texts = [scrape(server, index) for index in (0, 1)]
    after = [http_counts(text) for text in texts]
    assert after[0] == after[1]
    delta = {name: after[0][name] - before[0][name] for name in after[0]}
    assert delta["requests"] == sent
    assert delta["e2e_request_latency_seconds"] == delta["time_to_first_token_seconds"] == sent
    assert delta["request_queue_time_seconds"] == sent
    assert (delta["prompt_tokens"], delta["generation_tokens"]) == (prompt_tokens, generation_tokens)
    for text in texts:  # every family once: the engine's are not counted per server
        types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
        assert len(types) == len(set(types)), sorted(t for t in types if types.count(t) > 1)
    engine = [samples(text) for text in texts]
    assert engine[0][("sonar:engine_steps_total", ())] == engine[1][("sonar:engine_steps_total", ())]

    # /load: a stream open on the second server is in flight on either server's answer.
    client = client_on(server, 1)
    try:
        body = {**LONG, "stream": True, "ignore_eos": True}
        with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.headers[HEADER] == "1"
            lines = r.iter_lines()  # kept: a closed line iterator would close the connection
            for line in lines:
                if line.startswith("data: "):
                    break
            assert (load(server, 0), load(server, 1)) == (1, 1)
            lines.close()
    finally:
        client.close()
    deadline = time.monotonic() + 10
    while (load(server, 0), load(server, 1)) != (0, 0):
        assert time.monotonic() < deadline, "a finished request still counts in /load"
        time.sleep(0.1)


def test_killing_the_second_server_loses_no_request_of_the_first_and_it_comes_back(server, expected) -> None:
    victim = api1(server.base_url)
    assert victim is not None and victim["state"] == "running"
    body = {**COMPLETION, "max_tokens": 48, "ignore_eos": True}
    longer = {
        p: httpx.post(f"{server.base_url}/v1/completions", json={**body, "prompt": p}, timeout=120) for p in PROMPTS
    }
    counted = http_counts(scrape(server, 0))["requests"]
    results: dict[int, httpx.Response | Exception] = {}

    def one(i: int) -> None:
        try:
            payload = {**body, "prompt": PROMPTS[i % len(PROMPTS)]}
            results[i] = httpx.post(f"{server.base_url}/v1/completions", json=payload, timeout=120)
        except httpx.TransportError as exc:  # a request on the killed server: its connection is gone
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while samples(get(server, "/metrics").text)[("sonar:num_requests_running", ())] < 2:
        assert time.monotonic() < deadline, "the requests did not start"
        time.sleep(0.05)
    os.kill(victim["pid"], signal.SIGKILL)
    for t in threads:
        t.join(timeout=180)
    assert sorted(results) == list(range(12))
    on_first = [(i, r) for i, r in results.items() if isinstance(r, httpx.Response) and r.headers.get(HEADER) == "0"]
    assert on_first, "no request landed on the first server"
    for i, r in on_first:
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == longer[PROMPTS[i % len(PROMPTS)]].json()["choices"][0]["text"]
    for r in results.values():  # the rest died with the killed server, or were served by it before
        assert isinstance(r, httpx.TransportError) or r.status_code == 200

    pid = wait_for_second_server(server)
    assert pid != victim["pid"]
    node = api1(server.base_url)
    assert node is not None and node["restarts"] == 1
    tries = 0

    def ask_again() -> httpx.Response:
        nonlocal tries
        tries += 1
        return httpx.post(f"{server.base_url}/v1/chat/completions", json=chat(PROMPTS[1]), timeout=60)

    again = on_server(1, ask_again)
    assert again is not None and again.json()["choices"][0]["message"]["content"] == expected["chat", PROMPTS[1]]
    # The engine holds nothing of the killed server's requests.
    deadline = time.monotonic() + 10
    while samples(get(server, "/metrics").text)[("sonar:num_requests_running", ())] != 0:
        assert time.monotonic() < deadline, "requests of the killed server still run in the engine"
        time.sleep(0.1)
    # What the killed server counted stays (its files outlive it), the restarted one counts anew
    # (under its new pid): every answered request once, plus at most those the killed server
    # finished but could not send. Its requests in flight are no longer in /load.
    answered = sum(isinstance(r, httpx.Response) for r in results.values())
    totals = [http_counts(scrape(server, index))["requests"] - counted for index in (0, 1)]
    assert totals[0] == totals[1]
    assert answered + tries <= totals[0] <= len(results) + tries  # + the chats until api1 answered
    deadline = time.monotonic() + 10
    while (load(server, 0), load(server, 1)) != (0, 0):
        assert time.monotonic() < deadline, "the killed server's requests still count in /load"
        time.sleep(0.1)


def test_sigterm_aborts_the_requests_on_both_servers_and_stops_every_process(server) -> None:
    pid = api1(server.base_url)["pid"]  # type: ignore[index]
    streams: list[tuple[str, list[Any]]] = []
    lock = threading.Lock()
    opened = threading.Event()

    def one() -> None:
        body = {**LONG, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as r:
            index = r.headers[HEADER]
            with lock:
                streams.append((index, (events := [])))
                if {s for s, _ in streams} == {"0", "1"}:
                    opened.set()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])

    threads = []
    for _ in range(16):  # until both servers stream at least one
        t = threading.Thread(target=one)
        t.start()
        threads.append(t)
        if opened.wait(0.5):
            break
    # A stream's headers go out with its first token: one waiting for KV blocks (four of these
    # streams fill the cache) opens when an earlier one has finished.
    assert opened.wait(60), "no stream reached each server"
    time.sleep(0.5)
    started = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=30) == 0, server.log()[-4000:]
    assert time.monotonic() - started < 15
    for t in threads:
        t.join(timeout=30)
    for index in ("0", "1"):
        ended = [events for s, events in streams if s == index]
        assert ended and all(events[-1] == "[DONE]" and '"finish_reason":"abort"' in events[-2] for events in ended)
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


def test_an_engine_that_gives_up_ends_the_requests_of_both_servers_with_503(tmp_path: Path) -> None:
    """The owner forwards the engine's give-up to the other API server: its requests end with a
    503 OpenAI error as the owner's do (not a dropped connection), and every process exits."""
    server = start_server(tmp_path, "--api-server-count", "2", *ARGS, *GIVES_UP)
    try:
        pid = wait_for_second_server(server)
        results: dict[int, httpx.Response | Exception] = {}

        def one(i: int) -> None:
            try:
                payload = {**COMPLETION, "prompt": PROMPTS[i % len(PROMPTS)]}
                results[i] = httpx.post(f"{server.base_url}/v1/completions", json=payload, timeout=150)
            except httpx.TransportError as exc:
                results[i] = exc

        threads = [threading.Thread(target=one, args=(i,)) for i in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=200)
        assert sorted(results) == list(range(10))
        served_by = set()
        for r in results.values():
            assert isinstance(r, httpx.Response), f"a request lost its connection: {r!r}\n{server.log()[-3000:]}"
            assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError", r.text
            served_by.add(r.headers[HEADER])
        assert served_by == {"0", "1"}
        assert server.proc.wait(timeout=30) == 1
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    finally:
        stop_server(server)


def test_a_killed_owners_metrics_directory_is_removed_at_the_next_start(tmp_path: Path) -> None:
    import subprocess
    import sys

    from sonar.cli.api_servers import METRICS_PREFIX, sweep_metrics

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = tmp_path / f"{METRICS_PREFIX}{dead.pid}-abc"
    live = tmp_path / f"{METRICS_PREFIX}{os.getpid()}-def"
    other = tmp_path / "sonar-metrics-notapid"
    for path in (left, live, other):
        path.mkdir()
        (path / "counter_1.db").write_bytes(b"x")
    assert sweep_metrics(str(tmp_path)) == [str(left)]
    assert not left.exists() and live.exists() and other.exists()
