"""The telemetry flags on one real `python -m sonar serve`: --otlp-traces-endpoint, --kv-cache-metrics
(every block followed) and --enable-mfu-metrics.

Tracing exports to a real OTLP/HTTP receiver started here (`tests.otlp_receiver`: POST /v1/traces,
the protobuf bodies decoded with `opentelemetry.proto`). The spans must name the request, count its
tokens, time it, continue the client's trace (``traceparent``) and, with --collect-detailed-traces,
link to the scheduler's step spans that served it; a receiver gone must not fail or slow a request
(that test comes last: the receiver stays down).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sonar.cli import parse_serve_args
from sonar.cli.errors import UsageError
from sonar.core.outputs import RequestModelTime
from sonar.http.tracing import SpanTimes, TracingConfigError, span_attributes, traces_url
from sonar.sampling_params import SamplingParams
from tests.http.conftest import ServerProcess, serving, sse_events
from tests.otlp_receiver import Receiver, attributes

SERVER_ARGS = (
    *("--dtype", "float32", "--max-model-len", "256", "--num-gpu-blocks-override", "64", "--seed", "0"),
    *("--kv-cache-metrics", "--kv-cache-metrics-sample", "1", "--enable-mfu-metrics", "--enable-prompt-tokens-details"),
    *("--collect-detailed-traces", "all"),
)
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, receiver: Receiver) -> Iterator[ServerProcess]:
    # no path: /v1/traces is added
    with serving(tmp_path_factory.mktemp("tracing"), *SERVER_ARGS, "--otlp-traces-endpoint", receiver.endpoint) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def test_traces_url_adds_the_otlp_path_only_when_none_is_given() -> None:
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("https://collector:4318/custom/traces") == "https://collector:4318/custom/traces"
    for bad in ("collector:4317", "grpc://collector:4317", "http://"):
        with pytest.raises(TracingConfigError, match="OTLP/HTTP"):
            traces_url(bad)


def test_a_completion_is_one_span_in_the_clients_trace(http: httpx.Client, receiver: Receiver) -> None:
    body = {"prompt": "The sea was calm that", "max_tokens": 5, "ignore_eos": True, "temperature": 0.7, "top_p": 0.9}
    r = http.post("/v1/completions", json=body, headers={"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN}-01"})
    assert r.status_code == 200, r.text
    out = r.json()
    (span,) = receiver.spans_of(out["id"])
    assert span.name == "llm_request"
    assert span.trace_id.hex() == TRACE_ID
    assert span.parent_span_id.hex() == PARENT_SPAN
    a = attributes(span)
    assert a["gen_ai.response.model"] == out["model"]
    assert a["gen_ai.usage.prompt_tokens"] == out["usage"]["prompt_tokens"] > 0
    assert a["gen_ai.usage.completion_tokens"] == out["usage"]["completion_tokens"] == 5
    assert a["gen_ai.request.temperature"] == pytest.approx(0.7)
    assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["gen_ai.request.max_tokens"] == 5 and a["gen_ai.request.n"] == 1
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    e2e, ttft = a["gen_ai.latency.e2e"], a["gen_ai.latency.time_to_first_token"]
    queue, prefill = a["gen_ai.latency.time_in_queue"], a["gen_ai.latency.time_in_model_prefill"]
    decode = a["gen_ai.latency.time_in_model_decode"]
    assert 0 <= queue and 0 < prefill and 0 < decode
    assert queue + prefill <= ttft + 0.05  # the scheduler's share of the time to first token
    assert ttft + decode == pytest.approx(e2e, abs=0.05)
    assert a["gen_ai.latency.time_in_model_inference"] == pytest.approx(prefill + decode)
    # --collect-detailed-traces all: the worker's time on the request's five steps, and its forward passes'
    execute, forward = a["gen_ai.latency.time_in_model_execute"], a["gen_ai.latency.time_in_model_forward"]
    assert 0 < forward < execute < e2e
    span_seconds = (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9
    assert span_seconds == pytest.approx(e2e, abs=0.01)
    # and links to the scheduler's spans of those five steps (one prefill, four decodes)
    assert a["sonar.steps"] == a["sonar.steps.linked"] == len(span.links) == 5
    steps = receiver.spans_by_id({link.span_id for link in span.links})
    assert {s.name for s in steps.values()} == {"scheduler.step"}
    assert {s.trace_id for s in steps.values()} == {link.trace_id for link in span.links}
    assert all(span.start_time_unix_nano <= s.start_time_unix_nano < span.end_time_unix_nano for s in steps.values())
    assert all(path == "/v1/traces" for path in receiver.paths)
    services = {
        kv.value.string_value for res in receiver.resources for kv in res.attributes if kv.key == "service.name"
    }
    assert services == {"sonar"}


def test_three_requests_steps_add_up_to_the_tokens_served(http: httpx.Client, receiver: Receiver) -> None:
    """Three requests at once: the step spans their spans link to are every step they were in,
    and what those steps computed and sampled is exactly what the requests were served."""
    bodies = [
        {"prompt": f"Request {name} asks about the {topic}", "max_tokens": n, "ignore_eos": True}
        for name, topic, n in (("one", "tides", 4), ("two", "reefs and kelp", 6), ("three", "gulls", 3))
    ]
    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(lambda body: http.post("/v1/completions", json=body), bodies))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    usages = [r.json()["usage"] for r in replies]
    request_spans = [receiver.spans_of(r.json()["id"])[0] for r in replies]
    linked: set[bytes] = set()
    for span, usage in zip(request_spans, usages):
        # a prompt computed in one step, then a step per generated token but the last
        assert len(span.links) == attributes(span)["sonar.steps"] == usage["completion_tokens"]
        linked |= {link.span_id for link in span.links}
    steps = list(receiver.spans_by_id(linked).values())
    served = sum(u["completion_tokens"] for u in usages)
    computed = sum(u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"] for u in usages) + served - 3
    a = [attributes(s) for s in steps]
    assert sum(x["sonar.step.batch_size"] for x in a) == served  # each request is in one step per token
    assert sum(x["sonar.step.sampled_tokens"] for x in a) == served
    assert sum(x["sonar.step.tokens"] for x in a) == computed
    assert sum(x["sonar.step.prefill_requests"] for x in a) == 3
    assert all(x["sonar.step.prefill_tokens"] + x["sonar.step.decode_tokens"] == x["sonar.step.tokens"] for x in a)
    assert all(x["sonar.step.preemptions"] == 0 for x in a)
    for step in steps:  # --collect-detailed-traces all: the scheduler's and the worker's parts, inside the step
        children = {c.name: c for c in receiver.wait_for(lambda c: c.parent_span_id == step.span_id, 4)}
        assert set(children) == {"scheduler.schedule", "worker.execute", "worker.sample", "model.forward"}
        for child in children.values():
            assert child.trace_id == step.trace_id
            assert child.start_time_unix_nano <= child.end_time_unix_nano
            # the worker's clock is read in its own process: allow a millisecond of conversion skew
            assert step.start_time_unix_nano - 1_000_000 <= child.start_time_unix_nano
            assert child.end_time_unix_nano <= step.end_time_unix_nano + 1_000_000
        execute, forward, sample = children["worker.execute"], children["model.forward"], children["worker.sample"]
        assert execute.start_time_unix_nano <= forward.start_time_unix_nano <= forward.end_time_unix_nano
        assert forward.end_time_unix_nano <= sample.start_time_unix_nano <= sample.end_time_unix_nano
        assert sample.end_time_unix_nano <= execute.end_time_unix_nano
        assert children["scheduler.schedule"].end_time_unix_nano <= execute.start_time_unix_nano + 1_000_000


def test_a_streamed_chat_with_two_choices_is_two_spans_of_a_new_trace(
    server: ServerProcess, receiver: Receiver
) -> None:
    body = {
        "messages": [{"role": "user", "content": "Name a fish."}],
        "max_tokens": 3,
        "ignore_eos": True,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            events = [e for e in sse_events(r) if e != "[DONE]"]
    rid = events[0]["id"]
    spans = receiver.spans_of(rid, count=2)
    assert len(spans) == 2
    assert sorted(attributes(s)["sonar.choice_index"] for s in spans) == [0, 1]
    usage = events[-1]["usage"]
    for span in spans:
        a = attributes(span)
        assert span.parent_span_id == b""  # no traceparent: the span starts its own trace
        assert a["gen_ai.request.n"] == 2
        assert a["gen_ai.usage.completion_tokens"] == 3
        assert a["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    assert spans[0].trace_id != spans[1].trace_id


def test_a_response_is_traced_too(http: httpx.Client, receiver: Receiver) -> None:
    r = http.post("/v1/responses", json={"input": "Say hi", "max_output_tokens": 2, "store": False})
    assert r.status_code == 200, r.text
    out = r.json()
    (span,) = receiver.spans_of(out["id"])
    a = attributes(span)
    assert a["gen_ai.usage.completion_tokens"] == out["usage"]["output_tokens"]
    assert a["gen_ai.usage.prompt_tokens"] == out["usage"]["input_tokens"]


def test_a_malformed_traceparent_starts_a_new_trace(http: httpx.Client, receiver: Receiver) -> None:
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers={"traceparent": "nonsense"})
    assert r.status_code == 200, r.text
    (span,) = receiver.spans_of(r.json()["id"])
    assert span.parent_span_id == b""


def scrape(http: httpx.Client) -> dict[str, float]:
    r = http.get("/metrics")
    assert r.status_code == 200, r.text
    return {
        s.name + ("{" + s.labels["le"] + "}" if "le" in s.labels else ""): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def test_a_repeated_prompt_counts_reuse_gaps_and_eviction_counts_lifetimes(http: httpx.Client) -> None:
    prompt = "Reuse me: " + " ".join(f"harbor{i}" for i in range(40))  # a few full blocks
    before = scrape(http)
    for _ in range(3):
        r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        assert r.status_code == 200, r.text
    after = scrape(http)
    reused = after["sonar:kv_block_reuse_gap_seconds_count"] - before.get("sonar:kv_block_reuse_gap_seconds_count", 0)
    full_blocks = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] // 16
    assert full_blocks >= 2
    assert reused == 2 * full_blocks  # the second and the third request hit each full block
    assert after["sonar:kv_block_reuse_gap_seconds_bucket{+Inf}"] == after["sonar:kv_block_reuse_gap_seconds_count"]
    assert after["sonar:kv_block_reuse_gap_seconds_sum"] > before.get("sonar:kv_block_reuse_gap_seconds_sum", 0)

    # Distinct long prompts fill the 64 blocks, and then evict cached ones.
    for i in range(8):
        words = " ".join(f"tide{i}x{j}" for j in range(40))
        r = http.post("/v1/completions", json={"prompt": words, "max_tokens": 1})
        assert r.status_code == 200, r.text
    evicted = scrape(http)
    assert evicted["sonar:kv_block_lifetime_seconds_count"] > after.get("sonar:kv_block_lifetime_seconds_count", 0)
    assert evicted["sonar:kv_block_idle_before_evict_seconds_count"] > 0
    assert evicted["sonar:kv_block_lifetime_seconds_sum"] >= evicted["sonar:kv_block_idle_before_evict_seconds_sum"]


# SmolLM2-135M, the embedded model: 30 layers, hidden 576, 9 query and 3 KV heads of 64, MLP 1536.
LAYERS, HIDDEN, Q_DIM, KV_DIM, MLP, VOCAB = 30, 576, 9 * 64, 3 * 64, 1536, 49152
LAYER_WEIGHTS = HIDDEN * Q_DIM + 2 * HIDDEN * KV_DIM + Q_DIM * HIDDEN + 3 * HIDDEN * MLP


def expected_cost(cached: int, prompt: int, generated: int) -> tuple[int, int]:
    """FLOPs and float32 bytes read of a request, by the formula of `sonar.core.flops`, written
    out: one prefill step of the uncached prompt, then one step per generated token but the last."""
    steps = [(cached, prompt - cached)] + [(prompt + i, 1) for i in range(generated - 1)]
    flops = read = 0
    for start, n in steps:
        flops += (
            2 * LAYER_WEIGHTS * LAYERS * n + 2 * HIDDEN * VOCAB + 4 * Q_DIM * LAYERS * (n * start + n * (n + 1) // 2)
        )
        read += 4 * (LAYER_WEIGHTS * LAYERS + HIDDEN * VOCAB + 2 * KV_DIM * LAYERS * (start + n))
    return flops, read


def test_mfu_counters_equal_the_formula_for_a_known_request(http: httpx.Client) -> None:
    before = scrape(http)
    body = {"prompt": "Count me: a gull, a crab, a kelp forest", "max_tokens": 4, "ignore_eos": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    after = scrape(http)
    usage = r.json()["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    flops, read = expected_cost(cached, usage["prompt_tokens"], usage["completion_tokens"])
    assert after["sonar:estimated_flops_per_gpu_total"] - before["sonar:estimated_flops_per_gpu_total"] == flops
    assert (
        after["sonar:estimated_read_bytes_per_gpu_total"] - before["sonar:estimated_read_bytes_per_gpu_total"] == read
    )
    busy = after["sonar:model_busy_seconds_total"] - before["sonar:model_busy_seconds_total"]
    assert 0 < busy < 30
    # On the CPU the peak is cores x clock x vector FLOPs per cycle: known, so utilization is reported.
    assert after["sonar:peak_flops_per_gpu"] > 1e9
    assert 0 < after["sonar:model_flops_utilization"] < 1


def test_requests_go_on_when_the_collector_is_gone(http: httpx.Client, receiver: Receiver) -> None:
    receiver.stop()  # last in the module: the receiver stays down
    started = time.monotonic()
    for _ in range(3):
        r = http.post("/v1/completions", json={"prompt": "Still there?", "max_tokens": 2})
        assert r.status_code == 200, r.text
    assert time.monotonic() - started < 10  # never waits for the exporter's retries


def test_a_bad_endpoint_stops_the_start() -> None:
    with pytest.raises(UsageError, match="--otlp-traces-endpoint"):
        parse_serve_args(["--otlp-traces-endpoint", "collector:4317"])


def test_detailed_traces_need_an_endpoint_and_name_their_modules() -> None:
    with pytest.raises(UsageError, match="--collect-detailed-traces: needs --otlp-traces-endpoint"):
        parse_serve_args(["--collect-detailed-traces", "all"])
    endpoint = ["--otlp-traces-endpoint", "http://127.0.0.1:4318"]
    modules = {
        value: (config.engine.trace_worker, config.engine.trace_model)
        for value in ("model", "worker", "all", "model,worker", "worker,all")
        for config in [parse_serve_args([*endpoint, "--collect-detailed-traces", value])]
    }
    assert modules == {
        "model": (False, True),
        "worker": (True, False),
        "all": (True, True),
        "model,worker": (True, True),
        "worker,all": (True, True),
    }


def test_a_sample_rate_without_kv_cache_metrics_is_refused() -> None:
    with pytest.raises(UsageError, match="--kv-cache-metrics-sample: takes effect only with --kv-cache-metrics"):
        parse_serve_args(["--kv-cache-metrics-sample", "0.5"])
    with pytest.raises(UsageError, match=r"fraction in \(0, 1\]"):
        parse_serve_args(["--kv-cache-metrics", "--kv-cache-metrics-sample", "0"])
    config = parse_serve_args(["--kv-cache-metrics", "--kv-cache-metrics-sample", "0.5"]).engine
    assert (config.kv_cache_metrics, config.kv_cache_metrics_sample) == (True, 0.5)


def test_only_the_modules_asked_for_become_attributes() -> None:
    params = SamplingParams(max_tokens=3)
    times = SpanTimes(0.0, 1.0, model_time=RequestModelTime(None, 0.25))
    a = span_attributes("cmpl-1", "m", params, 4, 3, times, "length")
    assert a["gen_ai.latency.time_in_model_forward"] == 0.25
    assert "gen_ai.latency.time_in_model_execute" not in a
    assert "gen_ai.latency.time_to_first_token" not in a  # never reached
