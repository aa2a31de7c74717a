"""`python -m sonar bench serve` against a real `python -m sonar serve` subprocess."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sonar.__main__ import main
from tests.bench.conftest import SERVER_ARGS, assert_ordered, assert_png
from tests.http.conftest import serving


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with serving(tmp_path_factory.mktemp("bench-serve"), *SERVER_ARGS) as srv:
        yield srv


def bench(server: Any, tmp_path: Path, *flags: str) -> tuple[dict[str, Any], str]:
    """Run `bench serve` in this process with --save-result; (the saved JSON, the printed report)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(
            [
                "bench",
                "serve",
                "--base-url",
                server.base_url,
                "--disable-tqdm",
                "--save-result",
                "--result-dir",
                str(tmp_path),
                "--result-filename",
                "result.json",
                *flags,
            ]
        )
    report = out.getvalue()
    assert code == 0, report
    return json.loads((tmp_path / "result.json").read_text()), report


def test_random_completions_report(server: Any, tmp_path: Path) -> None:
    plot = tmp_path / "serve.png"
    result, report = bench(
        server,
        tmp_path,
        "--backend",
        "openai",
        "--dataset-name",
        "random",
        "--num-prompts",
        "6",
        "--random-input-len",
        "32",
        "--random-output-len",
        "8",
        "--max-concurrency",
        "3",
        "--ignore-eos",
        "--num-warmups",
        "1",
        "--goodput",
        "ttft:600000",
        "e2el:600000",
        "--metric-percentiles",
        "90,99",
        "--server-pid",
        str(server.proc.pid),
        "--floor-dtype",
        "float32",
        "--plot",
        str(plot),
    )

    assert result["completed"] == 6 and result["failed"] == 0, result["errors"]
    assert result["total_output_tokens"] == 6 * 8  # --ignore-eos: every request runs to max_tokens
    assert all(n == 8 for n in result["output_lens"])
    assert result["total_input_tokens"] > 0
    for key in (
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "peak_output_throughput",
        "duration",
    ):
        assert result[key] > 0, key
    # Generous SLOs: every request meets them, so goodput equals the request throughput.
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert 1 <= result["peak_concurrent_requests"] <= 3
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert_ordered(result, metric, ["p90", "p99"])
    assert result["mean_ttft_ms"] < result["mean_e2el_ms"]
    # One gap per streamed chunk after the first; a chunk may carry more than one token (text that
    # ends inside a UTF-8 character waits for the next token).
    assert len(result["itls"]) == 6 and all(1 <= len(gaps) <= 7 for gaps in result["itls"])

    server_side = result["server"]
    assert server_side["metrics_available"]
    assert 0 < server_side["peak_kv_cache_usage"] <= 1
    assert server_side["num_preemptions"] == 0
    assert server_side["prefix_cache_queries"] > 0
    assert server_side["rss_bytes_peak"] > 100 * 2**20  # read from /proc/PID (Sonar exports no process_*)

    floor = result["floor"]
    assert floor["params"] == pytest.approx(134.5e6, rel=0.01)  # SmolLM2-135M, from its local config
    assert floor["weight_bytes"] == pytest.approx(4 * floor["params"])
    assert floor["floor_ms"] > 0 and floor["tpot_over_floor"] > 1
    # the server is on this machine: its read bandwidth was measured here, after the run
    assert floor["bandwidth_measured"] and floor["bandwidth_gbs"] > 0.5 and result["floor_missing"] is None

    for line in (
        "Serving Benchmark Result",
        "Successful requests:",
        "Request goodput (req/s):",
        "Mean TTFT (ms):",
        "P99 ITL (ms):",
        "Peak KV cache usage (%):",
        "floor per step",
    ):
        assert line in report, line
    assert_png(plot)


def test_prefix_repetition_chat_hits_the_prefix_cache(server: Any, tmp_path: Path) -> None:
    result, report = bench(
        server,
        tmp_path,
        "--backend",
        "openai-chat",
        "--dataset-name",
        "prefix-repetition",
        "--num-prompts",
        "4",
        "--prefix-repetition-prefix-len",
        "64",
        "--prefix-repetition-suffix-len",
        "8",
        "--prefix-repetition-num-prefixes",
        "2",
        "--prefix-repetition-output-len",
        "4",
        "--max-concurrency",
        "1",
        "--seed",
        "7",
        "--percentile-metrics",
        "ttft,e2el",
        "--metric-percentiles",
        "50,99",
    )
    assert result["completed"] == 4 and result["failed"] == 0, result["errors"]
    assert result["backend"] == "openai-chat" and result["endpoint"] == "/v1/chat/completions"
    assert all(0 < n <= 4 for n in result["output_lens"])
    # Sequential requests, two per prefix: the second of each finds its prefix cached.
    assert result["server"]["prefix_cache_hit_rate"] > 0.2
    assert result["peak_concurrent_requests"] == 1
    assert_ordered(result, "ttft", ["p50", "p99"])
    assert "Mean TPOT" not in report and "P50 E2EL (ms):" in report


def test_sharegpt_at_a_request_rate(server: Any, tmp_path: Path) -> None:
    data = [
        {
            "conversations": [
                {"from": "human", "value": f"Question {i}: what is the colour of the sky at noon?"},
                {"from": "gpt", "value": "It is usually blue, because of Rayleigh scattering."},
            ]
        }
        for i in range(3)
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    result, _ = bench(
        server,
        tmp_path,
        "--dataset-name",
        "sharegpt",
        "--dataset-path",
        str(path),
        "--num-prompts",
        "3",
        "--sharegpt-output-len",
        "4",
        "--ignore-eos",
        "--request-rate",
        "20",
        "--burstiness",
        "0.5",
    )
    assert result["completed"] == 3 and result["total_output_tokens"] == 12
    assert result["request_rate"] == 20.0 and result["dataset_name"] == "sharegpt"
    starts = result["start_times"]
    assert starts == sorted(starts) and starts[-1] > 0  # sent on the arrival schedule, not all at once


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_a_stream_of_tokens_without_text_counts_as_answered(server: Any, backend: str) -> None:
    """Every token biased to a special one (skipped in the text, EOS ignored): the request
    answered all its tokens, so it is a success timed from its first chunk, not "no token"."""
    import anyio
    import httpx

    from sonar.bench.datasets import SampleRequest
    from sonar.bench.endpoint import BACKENDS, send_request

    special = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "<|im_end|>"}).json()["tokens"]
    assert len(special) == 1
    model = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]
    sample = SampleRequest("Name a colour.", 5, 6)

    async def run(extra: dict[str, Any] | None) -> Any:
        async with httpx.AsyncClient(timeout=60) as client:
            url = server.base_url + BACKENDS[backend]
            return await send_request(client, url, backend, model, sample, True, extra)

    silent = anyio.run(run, {"logit_bias": {str(special[0]): 100}})
    assert silent.success and not silent.error
    assert silent.text == "" and silent.token_times == []
    assert silent.output_tokens == 6
    assert 0 < silent.ttft <= silent.latency
    spoken = anyio.run(run, None)  # the same request with text: timed from its first piece of text
    assert spoken.success and spoken.text and spoken.output_tokens == 6 and len(spoken.token_times) >= 1


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_an_answer_asked_for_whole_is_timed_as_a_whole(server: Any, backend: str) -> None:
    """`--no-stream`: the request goes without ``stream``, its text and output length come from the
    one answer, and its first token is seen with its last (the report's TPOT: latency over tokens)."""
    import anyio
    import httpx

    from sonar.bench.datasets import SampleRequest
    from sonar.bench.endpoint import BACKENDS, send_request
    from sonar.bench.stats import summarize

    model = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]
    sample = SampleRequest("Name a colour.", 5, 12)

    async def run(stream: bool) -> Any:
        async with httpx.AsyncClient(timeout=60) as client:
            url = server.base_url + BACKENDS[backend]
            return await send_request(client, url, backend, model, sample, True, stream=stream)

    whole, streamed = anyio.run(run, False), anyio.run(run, True)
    assert whole.success and not whole.streamed and whole.output_tokens == 12
    assert whole.text == streamed.text  # greedy: the same answer either way
    assert whole.ttft == pytest.approx(whole.latency, abs=0.01) and whole.itl == []
    summary = summarize([whole], whole.latency, [50])
    assert summary["mean_tpot_ms"] == pytest.approx(whole.latency / 12 * 1e3)
    assert summary["total_output_tokens"] == 12
