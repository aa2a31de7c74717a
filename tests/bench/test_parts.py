"""The pieces of `bench serve` that need no server: datasets, arrivals, statistics, metrics, floor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sonar.actors.host import is_loopback
from sonar.bench.datasets import DatasetArgs, sample_requests
from sonar.bench.endpoint import RequestResult
from sonar.bench.floor import floor_from_args, format_floor, missing_floor, step_floor
from sonar.bench.json_schemas import SCHEMAS
from sonar.bench.model_info import load_tokenizer, model_params, param_count, resolve_model_files
from sonar.bench.serve import arrival_delays
from sonar.bench.server_metrics import MetricsPoller, parse_metrics, server_summary
from sonar.bench.stats import parse_goodput, summarize


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_files(None).tokenizer_dir)


def test_random_dataset_lengths_and_determinism(tokenizer) -> None:
    args = DatasetArgs(num_prompts=20, random_input_len=40, random_output_len=10, random_range_ratio=0.5, seed=3)
    a, b = sample_requests(args, tokenizer), sample_requests(args, tokenizer)
    assert [s.prompt for s in a] == [s.prompt for s in b]
    assert all(5 <= s.expected_output_len <= 15 for s in a)
    assert len({s.expected_output_len for s in a}) > 1
    # Re-encoding decoded random ids may merge a few tokens; the length stays near the drawn one.
    assert all(10 <= s.prompt_len <= 70 for s in a)
    assert all(s.prompt_len == len(tokenizer.encode(s.prompt, add_special_tokens=False)) for s in a)


def test_prefix_repetition_shares_prefixes(tokenizer) -> None:
    args = DatasetArgs(
        dataset_name="prefix-repetition",
        num_prompts=6,
        prefix_repetition_prefix_len=32,
        prefix_repetition_suffix_len=8,
        prefix_repetition_num_prefixes=2,
        prefix_repetition_output_len=5,
    )
    samples = sample_requests(args, tokenizer)
    assert len(samples) == 6 and all(s.expected_output_len == 5 for s in samples)
    heads = {s.prompt[:40] for s in samples}
    assert len(heads) == 2


def test_json_schema_dataset_sends_a_schema_per_request(tokenizer) -> None:
    import jsonschema

    from sonar.bench.endpoint import request_body

    args = DatasetArgs(dataset_name="json-schema", num_prompts=8, json_schema_output_len=32)
    samples = sample_requests(args, tokenizer)
    assert all(s.expected_output_len == 32 and s.json_schema is not None for s in samples)
    assert len({json.dumps(s.json_schema) for s in samples}) == 4  # the built-in schemas, in turn
    for s in samples:
        jsonschema.Draft202012Validator.check_schema(s.json_schema)
    body = request_body("openai-chat", "m", samples[0], ignore_eos=False)
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "bench", "schema": samples[0].json_schema},
    }

    unique = sample_requests(
        DatasetArgs(dataset_name="json-schema", num_prompts=8, json_schema_unique=True, json_schema_min_chars=500),
        tokenizer,
    )
    assert len({json.dumps(s.json_schema) for s in unique}) == 8
    assert all(list(s.json_schema["properties"])[0] == "notes" for s in unique)
    assert unique[0].json_schema["properties"]["notes"] == {"type": "string", "minLength": 500}

    off = sample_requests(DatasetArgs(dataset_name="json-schema", num_prompts=8, json_schema_off=True), tokenizer)
    assert [s.prompt for s in off] == [s.prompt for s in samples] and all(s.json_schema is None for s in off)
    assert "response_format" not in request_body("openai", "m", off[0], ignore_eos=True)


def test_sharegpt_file(tokenizer, tmp_path: Path) -> None:
    rows = [
        {
            "conversations": [
                {"from": "human", "value": "Tell me about the moon, please, in detail."},
                {"from": "gpt", "value": "The moon is Earth's only natural satellite, and so on."},
            ]
        },
        {"conversations": [{"from": "human", "value": "hi"}]},
    ]  # one turn only: skipped
    path = tmp_path / "g.json"
    path.write_text(json.dumps(rows))
    samples = sample_requests(DatasetArgs(dataset_name="sharegpt", dataset_path=str(path), num_prompts=3), tokenizer)
    assert len(samples) == 3 and samples[0].prompt.startswith("Tell me")
    assert samples[0].expected_output_len == len(
        tokenizer.encode(rows[0]["conversations"][1]["value"], add_special_tokens=False)
    )
    with pytest.raises(ValueError, match="dataset-path"):
        sample_requests(DatasetArgs(dataset_name="sharegpt"), tokenizer)


def test_edit_dataset_asks_to_repeat_its_passage(tokenizer) -> None:
    args = DatasetArgs(dataset_name="edit", num_prompts=4, edit_input_len=64, seed=3)
    samples = sample_requests(args, tokenizer)
    assert samples == sample_requests(args, tokenizer)
    for i, sample in enumerate(samples):
        ask, passage = sample.prompt.split(":\n\n", 1)
        passage = passage.removesuffix("\n\nResult:\n")
        assert ("Rename the variable" in ask) == (i % 2 == 1)  # prose and code in turn
        assert ("def step_0(" in passage) == (i % 2 == 1)
        passage_len = len(tokenizer.encode(passage, add_special_tokens=False))
        assert 64 <= passage_len < 64 + 48 and sample.expected_output_len >= 64
        assert sample.prompt_len == len(tokenizer.encode(sample.prompt, add_special_tokens=False))
    fixed = sample_requests(DatasetArgs(dataset_name="edit", num_prompts=1, edit_output_len=20), tokenizer)
    assert fixed[0].expected_output_len == 20


def test_arrivals() -> None:
    assert arrival_delays(5, float("inf"), 1.0, 0) == [0.0] * 5
    gaps = arrival_delays(4000, 10.0, 1.0, 0)
    assert sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.05)
    bursty = arrival_delays(4000, 10.0, 0.2, 0)
    assert sum(bursty) / len(bursty) == pytest.approx(0.1, rel=0.15)
    assert max(bursty) > max(gaps)  # lower burstiness: the same mean, more spread


def test_summary_and_goodput() -> None:
    def req(start: float, ttft: float, gaps: list[float]) -> RequestResult:
        times = [start + ttft]
        for g in gaps:
            times.append(times[-1] + g)
        return RequestResult(True, "", 10, len(times), ttft, times[-1] - start, gaps, start, times)

    results = [req(0.0, 0.1, [0.02] * 9), req(0.0, 0.3, [0.04] * 9), RequestResult(False, "boom", start=0.0)]
    s = summarize(results, 2.0, [50, 99], parse_goodput(["ttft:200", "tpot:30"]), t0=0.0)
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["total_output_tokens"] == 20 and s["output_throughput"] == 10.0
    assert s["mean_ttft_ms"] == pytest.approx(200.0)
    assert s["mean_tpot_ms"] == pytest.approx(30.0)
    assert s["request_goodput"] == pytest.approx(0.5)  # only the first meets ttft <= 200 ms and tpot <= 30 ms
    assert s["peak_concurrent_requests"] == 2
    with pytest.raises(ValueError):
        parse_goodput(["itl:5"])


def test_metrics_of_sonar_and_vllm() -> None:
    sonar_text = (
        "# TYPE sonar:kv_cache_usage_perc gauge\nsonar:kv_cache_usage_perc 0.25\n"
        "# TYPE sonar:num_preemptions counter\nsonar:num_preemptions_total 3.0\n"
    )
    vllm_text = (
        '# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc{engine="0"} 0.5\n'
        '# TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total{engine="0"} 100.0\n'
        '# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total{engine="0"} 40.0\n'
        "# TYPE process_resident_memory_bytes gauge\nprocess_resident_memory_bytes 1048576.0\n"
    )
    assert parse_metrics(sonar_text) == {"kv_cache_usage_perc": 0.25, "num_preemptions_total": 3.0}
    after = parse_metrics(vllm_text)
    assert after["kv_cache_usage_perc"] == 0.5
    before = {"prefix_cache_queries_total": 50.0, "prefix_cache_hits_total": 20.0}
    summary = server_summary(before, after, MetricsPoller(None, ""))  # type: ignore[arg-type]
    assert summary["prefix_cache_hit_rate"] == pytest.approx(0.4)
    assert summary["peak_kv_cache_usage"] == 0.5 and summary["rss_bytes_after"] == 1048576.0


def test_floor_and_parameter_count() -> None:
    files = resolve_model_files(None)
    # from the converted config.json when an earlier run converted the embedded GGUF under this
    # cache root, else from the GGUF's tensor shapes (a clean machine)
    assert model_params(files) == pytest.approx(134.5e6, rel=0.005)
    config = {
        "hidden_size": 576,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
    }  # SmolLM2-135M's
    assert param_count(config) == pytest.approx(134.5e6, rel=0.005)
    # the Llama formula would undercount a mixture of experts and miscount latent attention
    assert param_count({**config, "num_local_experts": 8}) is None
    assert param_count({**config, "kv_lora_rank": 512}) is None
    one = step_floor(134.5e6, "bfloat16", 1, 26.6, bandwidth_gbs=50.0)
    assert one.bound == "bandwidth" and one.floor_ms == pytest.approx(269e6 / 50e9 * 1e3, rel=0.01)
    sixteen = step_floor(134.5e6, "bfloat16", 16, 56.0, bandwidth_gbs=50.0)
    assert sixteen.bound == "compute" and sixteen.floor_ms == pytest.approx(2 * 134.5e6 * 16 / 390e9 * 1e3)
    assert sixteen.tpot_over_floor == pytest.approx(56.0 / sixteen.floor_ms)


def test_floor_bandwidth_is_given_or_measured_on_the_servers_machine() -> None:
    from sonar.bench.serve import build_parser

    for url in ("http://127.0.0.1:8000", "http://localhost:8000/v1", "http://[::1]:8000", "http://127.0.0.2:9"):
        assert is_loopback(url), url  # bench serve measures the bandwidth here for these
    for url in ("http://10.0.0.5:8000", "http://gpu-box:8000", "http://[2001:db8::1]:8000", "unix-socket"):
        assert not is_loopback(url), url

    measured = floor_from_args(build_parser().parse_args([]), 134.5e6, 1.0, 12.0, measured_gbs=30.0)
    assert measured.bandwidth_measured and measured.bandwidth_gbs == 30.0
    assert measured.floor_ms == pytest.approx(269e6 / 30e9 * 1e3, rel=0.01)
    assert "30.0 GB/s of reads, measured here" in "\n".join(format_floor(measured))
    # a bandwidth given on the command line wins over one measured here
    given = floor_from_args(build_parser().parse_args(["--peak-bandwidth-gbs", "40"]), 134.5e6, 1.0, 12.0, 30.0)
    assert not given.bandwidth_measured and given.bandwidth_gbs == 40.0
    assert "given" in "\n".join(format_floor(given))
    # a server elsewhere, no bandwidth given: no floor rather than one at another machine's bandwidth
    assert floor_from_args(build_parser().parse_args([]), 134.5e6, 1.0, 12.0) is None
    assert "--peak-bandwidth-gbs" in missing_floor(134.5e6)
    assert "--model-params" in missing_floor(None)


def test_bench_grammar_times_each_schema_cold_and_cached() -> None:
    import argparse

    from sonar.bench.grammar import format_report, run_grammar

    result = run_grammar(argparse.Namespace(model=None, backend=["xgrammar"], repeats=1, json=False))
    assert [row["schema"] for row in result["rows"]] == [subject for subject, _ in SCHEMAS]
    for row in result["rows"]:
        # A cached spec answers from the cache: far below the compile it saved.
        assert row["cached_ms"] < row["cold_ms"] and row["fill_us"] > 0
    assert "xgrammar" in format_report(result)
