"""The flag table against the reference: names, groups, defaults; implemented flags land in real fields."""

from __future__ import annotations

import msgspec
import pytest

from sonar.cli import FLAGS, GROUPS, Kind, ServeConfig, Status, parse_serve_args
from sonar.engine.config import EngineConfig

# (flag, the reference's documented default, how to read Sonar's parsed value; None: the table's default)
REFERENCE_DEFAULTS = [
    ("--port", 2242, lambda c: c.port),
    ("--host", None, lambda c: c.host),
    ("--uds", None, lambda c: c.uds),
    ("--uvicorn-log-level", "info", lambda c: c.uvicorn_log_level),
    ("--allowed-origins", ("*",), lambda c: c.allowed_origins),
    ("--allowed-methods", ("*",), lambda c: c.allowed_methods),
    ("--allowed-headers", ("*",), lambda c: c.allowed_headers),
    ("--allow-credentials", False, lambda c: c.allow_credentials),
    ("--response-role", "assistant", lambda c: c.response_role),
    ("--fingerprint-mode", "full", lambda c: c.fingerprint_mode),
    ("--ssl-cert-reqs", 0, lambda c: c.ssl_cert_reqs),
    ("--h11-max-incomplete-event-size", 4194304, lambda c: c.h11_max_incomplete_event_size),
    ("--h11-max-header-count", 256, lambda c: c.h11_max_header_count),
    ("--shutdown-timeout", 0, lambda c: c.shutdown_timeout),
    ("--generation-config", "auto", lambda c: c.generation_config),
    ("--override-generation-config", {}, lambda c: c.override_generation_config),
    ("--stream-interval", 1, lambda c: c.stream_interval),
    ("--enable-auto-tool-choice", False, lambda c: c.enable_auto_tool_choice),
    ("--tool-call-parser", None, lambda c: c.tool_call_parser),
    ("--tool-parser-plugin", "", lambda c: c.tool_parser_plugin),
    ("--reasoning-parser", "", lambda c: c.reasoning_parser),
    ("--reasoning-parser-plugin", "", lambda c: c.reasoning_parser_plugin),
    ("--gpu-memory-utilization", 0.92, lambda c: c.gpu_memory_utilization),
    ("--max-logprobs", 20, lambda c: c.max_logprobs),
    ("--enforce-eager", False, lambda c: c.enforce_eager),
    ("--dtype", "auto", lambda c: c.engine.dtype),
    ("--seed", 0, lambda c: c.engine.seed),
    ("--load-format", "auto", lambda c: c.engine.load_format),
    ("--max-model-len", None, lambda c: c.engine.max_model_len),
    ("--kv-cache-memory-bytes", None, lambda c: c.engine.kv_cache_memory_bytes),
    ("--prefix-caching-hash-algo", "sha256", lambda c: c.engine.prefix_caching_hash_algo),
    ("--scheduling-policy", "fcfs", lambda c: c.engine.scheduling_policy),
    ("--long-prefill-token-threshold", 0, lambda c: c.engine.long_prefill_token_threshold),
    ("--watermark", 0.0, lambda c: c.engine.watermark),
    ("--scheduler-reserve-full-isl", True, lambda c: c.engine.scheduler_reserve_full_isl),
    ("--tensor-parallel-size", 1, None),
    ("--pipeline-parallel-size", 1, None),
    ("--data-parallel-size", 1, lambda c: c.engine.data_parallel_size),
    ("--kv-cache-dtype", "auto", None),
    ("--tokenizer-mode", "auto", None),
    ("--max-lora-rank", 16, None),
    ("--master-port", 29501, None),
    ("--disable-cascade-attn", True, None),
    ("--enable-log-deltas", True, None),
    ("--use-tqdm-on-load", True, None),
    ("--safetensors-prefetch-block-size", 16777216, None),
    ("--optimization-level", 2, None),
    ("--mm-processor-cache-gb", 4, None),
    ("--ignore-patterns", ("original/**/*",), None),
    ("--enable-prefix-caching", None, None),
]


@pytest.fixture(scope="module")
def defaults() -> ServeConfig:
    return parse_serve_args([])


@pytest.mark.parametrize(("name", "documented", "read"), REFERENCE_DEFAULTS, ids=[r[0] for r in REFERENCE_DEFAULTS])
def test_default_matches_reference(defaults: ServeConfig, name: str, documented, read) -> None:
    assert FLAGS[name].default == documented
    if read is not None:
        assert read(defaults) == documented


def test_every_documented_flag_is_known() -> None:
    own = {
        "--placement",
        "--step-timeout",
        "--hang-margin",
        "--fault-injection",
        "--max-waiting-seqs",
        "--actor-keys",
        "--actor-max-frame-bytes",
        "--dequantize-weights",
        "--data-parallel-routing",
    }
    limits = {
        "--metrics-public",
        "--max-request-body-bytes",
        "--header-read-timeout",
        "--body-read-timeout",
        "--max-connections",
        "--max-prompt-chars",
        "--max-stop-strings",
        "--max-stop-string-chars",
        "--max-stop-token-ids",
        "--max-logit-bias",
        "--max-chat-messages",
        "--max-completions-per-request",
        "--max-stored-responses",
        "--max-stored-response-bytes",
        "--max-structured-output-chars",
        "--structured-outputs-compile-timeout",
    }
    assert {f.name for f in FLAGS.values() if f.group == "Limits"} == limits
    own |= limits
    assert len(FLAGS) - len(own) == 278
    assert own <= set(FLAGS)
    names = [f.name for g in GROUPS for f in g.flags]
    assert len(names) == len(set(names))
    assert FLAGS["--max-model-len"].group == "ModelConfig"
    assert FLAGS["--block-size"].group == "CacheConfig"
    assert FLAGS["--compilation-config"].group == "Sonar configuration"
    assert FLAGS["--tensor-parallel-size"].aliases == ("-tp",)
    assert FLAGS["--data-parallel-hybrid-lb"].aliases == ("-dph",)


def test_implemented_flags_target_real_fields() -> None:
    engine_fields = set(EngineConfig.__struct_fields__)
    serve_fields = set(ServeConfig.__struct_fields__)
    for flag in FLAGS.values():
        if flag.target is None or "." not in flag.target:
            continue
        part, field = flag.target.split(".")
        assert field in (engine_fields if part == "engine" else serve_fields), flag.name
        assert flag.why is None and not flag.accepts, flag.name


def test_every_flag_is_explained_and_none_is_a_no_op() -> None:
    """A flag either takes effect or is refused: there is no third status to accept and ignore."""
    assert set(Status) == {Status.IMPLEMENTED, Status.DEFAULT_ONLY}
    for flag in FLAGS.values():
        assert flag.help.strip(), flag.name
        if flag.why is not None:
            assert flag.status is Status.DEFAULT_ONLY and flag.why.strip(), flag.name
        both = flag.kind is Kind.BOOL and {True, False} <= set(flag.accepted_values())
        if flag.status is Status.DEFAULT_ONLY and both:
            assert flag.why, f"{flag.name}: accepting both values needs a why"


def _words(flag, value) -> list[str]:
    if flag.kind is Kind.BOOL:
        return [flag.name] if value else [f"--no-{flag.name[2:]}"]
    if isinstance(value, tuple):
        return [flag.name, *map(str, value)] if value else []
    if isinstance(value, dict):
        return [flag.name, msgspec.json.encode(value).decode()]
    return [flag.name, str(value)]


def test_every_flag_accepts_its_default_explicitly() -> None:
    """Passing a documented default is never an error: it means what leaving the flag out means."""
    checked = 0
    for flag in FLAGS.values():
        if flag.kind is Kind.HELP or flag.default is None or flag.target == "config":
            continue
        if flag.kind is Kind.BOOL and not flag.negatable and not flag.default:
            continue  # a store-true flag has no way to say False
        words = _words(flag, flag.default)
        if not words:
            continue
        parse_serve_args(words)
        checked += 1
    assert checked > 150


def test_data_parallel_flags_take_effect(usage_error) -> None:
    config = parse_serve_args(["-dp", "2", "--data-parallel-routing", "load"])
    assert (config.engine.data_parallel_size, config.engine.data_parallel_routing) == (2, "load")
    assert "must be positive, got 0" in usage_error("-dp", "0")
    assert "invalid choice: 'random'" in usage_error("--data-parallel-routing", "random")
    assert "KV offloading or KV events is not supported" in usage_error("-dp", "2", "--kv-offloading-size", "1")
    assert parse_serve_args(["-dp", "2", "-dpl", "2"]).engine.data_parallel_size == 2
    assert "--data-parallel-address is needed" in usage_error("-dp", "2", "-dpl", "1")  # the others elsewhere
    assert "--data-parallel-size-local must be in 1..1" in usage_error("-dpl", "2")
