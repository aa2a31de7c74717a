"""Value rules: human-readable ints, auto lengths, sizes, --no- forms, choices, lists, JSON flags."""

from __future__ import annotations

import pytest

from sonar.cli import parse_serve_args


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        ("4096", 4096),
        ("1k", 1000),
        ("1K", 1024),
        ("25.6k", 25600),
        ("32K", 32768),
        ("2M", 2 * 2**20),
    ],
)
def test_human_readable_ints(text: str, tokens: int) -> None:
    config = parse_serve_args(["--max-model-len", text, "--max-num-batched-tokens", text])
    assert config.engine.max_model_len == tokens
    assert config.engine.max_num_batched_tokens == tokens


@pytest.mark.parametrize("text", ["auto", "-1", "AUTO"])
def test_max_model_len_auto(text: str) -> None:
    assert parse_serve_args(["--max-model-len", text]).engine.max_model_len == -1
    assert parse_serve_args([f"--max-model-len={text}"]).engine.max_model_len == -1


def test_kv_cache_memory_bytes() -> None:
    assert parse_serve_args(["--kv-cache-memory-bytes", "2G"]).engine.kv_cache_memory_bytes == 2 * 2**30
    assert parse_serve_args(["--kv-cache-memory-bytes", "2g"]).engine.kv_cache_memory_bytes == 2 * 10**9
    assert parse_serve_args(["--kv-cache-memory-bytes", "1.5GiB"]).engine.kv_cache_memory_bytes == 3 * 2**29


def test_plain_ints_take_no_suffix(usage_error) -> None:
    assert usage_error("--max-num-seqs", "1k") == (
        "sonar serve: error: argument --max-num-seqs: expected an integer, got '1k'"
    )


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--max-num-seqs", "abc"], "argument --max-num-seqs: expected an integer, got 'abc'"),
        (["--max-num-seqs", "0"], "argument --max-num-seqs: must be positive, got 0"),
        (["--max-model-len", "1.5K"], "argument --max-model-len: invalid max model length"),
        (["--max-model-len", "0"], "argument --max-model-len: invalid max model length '0'"),
        (["--kv-cache-memory-bytes", "2 parsecs"], "argument --kv-cache-memory-bytes: invalid memory size"),
        (["--gpu-memory-utilization", "1.5"], "argument --gpu-memory-utilization/-gmu: must be a fraction"),
        (["--port", "70000"], "argument --port: a port must be in 0..65535"),
        (["--block-size", "24"], "argument --block-size: must be a positive power of two"),
        (["--watermark", "1"], "argument --watermark: must be in [0, 1)"),
        (["--max-num-seqs"], "argument --max-num-seqs: expected one argument"),
    ],
)
def test_bad_values_name_the_flag(usage_error, argv: list[str], expected: str) -> None:
    assert usage_error(*argv).startswith(f"sonar serve: error: {expected}")


def test_no_forms() -> None:
    assert parse_serve_args([]).engine.enable_prefix_caching is True  # engine default when unset
    assert parse_serve_args(["--no-enable-prefix-caching"]).engine.enable_prefix_caching is False
    assert parse_serve_args(["--enable-prefix-caching"]).engine.enable_prefix_caching is True
    assert parse_serve_args(["--no-enable-chunked-prefill"]).engine.enable_chunked_prefill is False
    assert parse_serve_args([]).engine.async_scheduling is None  # by device: on for CUDA, off on the CPU
    assert parse_serve_args(["--async-scheduling"]).engine.async_scheduling is True
    assert parse_serve_args(["--no-async-scheduling"]).engine.async_scheduling is False
    assert parse_serve_args(["--no-scheduler-reserve-full-isl"]).engine.scheduler_reserve_full_isl is False
    assert parse_serve_args(["--enforce-eager"]).enforce_eager is True
    assert parse_serve_args(["--enforce-eager", "--no-enforce-eager"]).enforce_eager is False


def test_no_form_only_where_documented(usage_error) -> None:
    assert parse_serve_args(["--disable-log-stats"]).disable_log_stats is True
    assert usage_error("--no-disable-log-stats") == (
        "sonar serve: error: unrecognized argument --no-disable-log-stats (did you mean --disable-log-stats?)"
    )


def test_choices_enforced(usage_error) -> None:
    assert usage_error("--dtype", "fp7") == (
        "sonar serve: error: argument --dtype: invalid choice: 'fp7' "
        "(choose from auto, bfloat16, float, float16, float32, half)"
    )
    assert "argument --scheduling-policy: invalid choice: 'lifo'" in usage_error("--scheduling-policy", "lifo")
    assert "argument --uvicorn-log-level: invalid choice" in usage_error("--uvicorn-log-level", "loud")


def test_choice_aliases() -> None:
    assert parse_serve_args(["--dtype", "half"]).engine.dtype == "float16"
    assert parse_serve_args(["--dtype", "float"]).engine.dtype == "float32"
    assert parse_serve_args(["--dtype", "bfloat16"]).engine.dtype == "bfloat16"
    assert parse_serve_args(["--generation-config", "aphrodite"]).generation_config == "sonar"


def test_model_positional_or_flag_and_served_names(usage_error) -> None:
    assert parse_serve_args(["org/model"]).engine.model == "org/model"
    assert parse_serve_args(["--model", "org/model"]).served_model_name == ("org/model",)
    config = parse_serve_args(["org/model", "--served-model-name", "a", "b"])
    assert config.served_model_name == ("a", "b")
    assert parse_serve_args([]).served_model_name == ("SmolLM2-135M-Instruct",)
    assert "the model is given twice" in usage_error("x", "--model", "y")
    assert usage_error("x", "y") == "sonar serve: error: unexpected argument 'y' (the model may be given only once)"


def test_lists_and_frontend_settings() -> None:
    config = parse_serve_args(
        [
            "--allowed-origins",
            "https://a.example",
            "https://b.example",
            "--api-key",
            "k1",
            "k2",
            "--disable-access-log-for-endpoints",
            "/health, /metrics",
            "--host",
            "127.0.0.1",
            "--uds",
            "/tmp/s",
        ]
    )
    assert config.allowed_origins == ("https://a.example", "https://b.example")
    assert config.api_key == ("k1", "k2")
    assert config.disable_access_log_for_endpoints == ("/health", "/metrics")
    assert (config.host, config.uds) == ("127.0.0.1", "/tmp/s")
    assert parse_serve_args(["--allowed-methods", '["GET", "POST"]']).allowed_methods == ("GET", "POST")


def test_json_flag_whole_value() -> None:
    config = parse_serve_args(["--override-generation-config", '{"temperature": 0.5, "top_k": 4}'])
    assert config.override_generation_config == {"temperature": 0.5, "top_k": 4}


def test_json_flag_dotted_keys() -> None:
    config = parse_serve_args(
        [
            "--override-generation-config.temperature",
            "0.5",
            '--override-generation-config.stop=["x"]',
            "--override-generation-config.nested.deeper",
            "text",
        ]
    )
    assert config.override_generation_config == {"temperature": 0.5, "stop": ["x"], "nested": {"deeper": "text"}}


def test_json_flag_dotted_keys_merge_over_whole_value() -> None:
    config = parse_serve_args(
        [
            "--override-generation-config.top_p",
            "0.9",
            "--override-generation-config",
            '{"temperature": 0.5, "top_p": 0.1}',
        ]
    )
    assert config.override_generation_config == {"temperature": 0.5, "top_p": 0.9}


def test_json_flag_errors(usage_error) -> None:
    assert usage_error("--override-generation-config", "{oops").startswith(
        "sonar serve: error: argument --override-generation-config: invalid JSON '{oops'"
    )
    assert "expected a JSON object" in usage_error("--override-generation-config", "[1, 2]")
    # A JSON flag not documented to take keys one by one takes only a whole object.
    assert usage_error("--hf-overrides.rope_theta", "1") == (
        "sonar serve: error: argument --hf-overrides: takes a whole JSON value, not --hf-overrides.KEY"
    )
    assert "expected one value" in usage_error("--override-generation-config.temperature")


def test_placement() -> None:
    config = parse_serve_args(["--placement", "worker=process,detokenizer=inprocess"])
    assert config.engine.placement == {"worker": "process", "detokenizer": "inprocess"}
    assert config.engine.describe_placement()["scheduler"] == "inprocess"


def test_placement_errors(usage_error) -> None:
    assert "argument --placement: unknown actor 'gpu'" in usage_error("--placement", "gpu=process")
    assert "argument --placement: unknown placement 'moon'" in usage_error("--placement", "worker=moon")
    assert "argument --placement: expected actor=where pairs" in usage_error("--placement", "worker")


def test_short_aliases_and_equals_forms() -> None:
    assert parse_serve_args(["-gmu", "0.5"]).gpu_memory_utilization == 0.5
    assert parse_serve_args(["--gpu-memory-utilization=0.7"]).gpu_memory_utilization == 0.7
    assert parse_serve_args(["-tp", "1", "-pp=1", "-O0"]).engine.model is None


def test_unknown_flag_suggests(usage_error) -> None:
    assert usage_error("--max-num-seq", "3") == (
        "sonar serve: error: unrecognized argument --max-num-seq (did you mean --max-num-seqs?)"
    )
    # No prefix abbreviations: with hundreds of flags they would be a trap.
    assert "unrecognized argument --max-num" in usage_error("--max-num", "3")
