"""The limit flags (group Limits): their values land in ServeConfig / EngineConfig, bad values
are usage errors naming the flag; and the warning of a server open to the network without a key."""

from __future__ import annotations

from sonar.cli import FLAGS, parse_serve_args
from sonar.cli.serve import exposure_warning
from sonar.engine.config import LIMITS, EngineConfig


def test_defaults() -> None:
    config = parse_serve_args([])
    assert config.max_request_body_bytes == 8 * 2**20
    assert (config.header_read_timeout, config.body_read_timeout, config.max_connections) == (10.0, 60.0, 2048)
    assert config.metrics_public is False
    engine = config.engine
    assert (
        engine.max_prompt_chars,
        engine.max_stop_strings,
        engine.max_stop_string_chars,
        engine.max_stop_token_ids,
        engine.max_logit_bias,
        engine.max_chat_messages,
        engine.max_completions_per_request,
    ) == (1_000_000, 64, 1024, 1024, 1024, 1024, 256)
    for name in LIMITS:  # the library's defaults are the server's
        assert getattr(EngineConfig(), name) == FLAGS["--" + name.replace("_", "-")].default


def test_values_land_in_the_config() -> None:
    config = parse_serve_args(
        [
            "--max-request-body-bytes",
            "1MiB",
            "--header-read-timeout",
            "2.5",
            "--body-read-timeout",
            "7",
            "--max-connections",
            "64",
            "--metrics-public",
            "--max-prompt-chars",
            "32k",
            "--max-stop-strings",
            "4",
            "--max-stop-string-chars",
            "16",
            "--max-stop-token-ids",
            "8",
            "--max-logit-bias",
            "300",
            "--max-chat-messages",
            "50",
            "--max-completions-per-request",
            "128",
        ]
    )
    assert (
        config.max_request_body_bytes,
        config.header_read_timeout,
        config.body_read_timeout,
        config.max_connections,
        config.metrics_public,
    ) == (2**20, 2.5, 7.0, 64, True)
    engine = config.engine
    assert (
        engine.max_prompt_chars,
        engine.max_stop_strings,
        engine.max_stop_string_chars,
        engine.max_stop_token_ids,
        engine.max_logit_bias,
        engine.max_chat_messages,
        engine.max_completions_per_request,
    ) == (32000, 4, 16, 8, 300, 50, 128)


def test_bad_values_name_the_flag(usage_error) -> None:
    for flag in (
        "--max-request-body-bytes",
        "--header-read-timeout",
        "--body-read-timeout",
        "--max-connections",
        "--max-prompt-chars",
        "--max-stop-strings",
        "--max-completions-per-request",
    ):
        message = usage_error(flag, "0")
        assert flag in message and "positive" in message, message
    assert "--max-logit-bias" in usage_error("--max-logit-bias", "many")


def test_exposure_warning() -> None:
    def warning(*argv: str) -> str | None:
        return exposure_warning(parse_serve_args(list(argv)))

    everywhere = warning()
    assert everywhere is not None and "all interfaces" in everywhere and "--api-key" in everywhere
    assert warning("--host", "10.0.0.5") is not None and "10.0.0.5" in warning("--host", "10.0.0.5")
    assert warning("--host", "db.internal") is not None
    for quiet in (
        ("--api-key", "k"),
        ("--host", "127.0.0.1"),
        ("--host", "::1"),
        ("--host", "localhost"),
        ("--uds", "/tmp/sonar.sock"),
    ):
        assert warning(*quiet) is None, quiet


def test_the_response_store_bounds(usage_error) -> None:
    config = parse_serve_args([])
    assert (config.max_stored_responses, config.max_stored_response_bytes) == (1024, 64 * 2**20)
    config = parse_serve_args(["--max-stored-responses", "0", "--max-stored-response-bytes", "1MiB"])
    assert (config.max_stored_responses, config.max_stored_response_bytes) == (0, 2**20)
    for flag in ("--max-stored-responses", "--max-stored-response-bytes"):
        assert flag in usage_error(flag, "-1")


def test_structured_outputs_flags_land_in_the_engine_config_and_bad_keys_are_refused(usage_error) -> None:
    engine = parse_serve_args([]).engine
    assert (engine.max_structured_output_chars, engine.structured_outputs_compile_timeout) == (65536, 10.0)
    assert engine.structured_config().backend == "auto"
    engine = parse_serve_args(
        [
            "--structured-outputs-config.backend",
            "guidance",
            "--structured-outputs-config.disable_any_whitespace",
            "true",
            "--max-structured-output-chars",
            "4096",
            "--structured-outputs-compile-timeout",
            "2.5",
        ]
    ).engine
    config = engine.structured_config()
    assert (config.backend, config.disable_any_whitespace, config.disable_additional_properties) == (
        "guidance",
        True,
        False,
    )
    assert (engine.max_structured_output_chars, engine.structured_outputs_compile_timeout) == (4096, 2.5)
    for words, message in (
        (["--structured-outputs-config", '{"backend": "outlines"}'], "backend='outlines'"),
        (["--structured-outputs-config.fast", "true"], "unknown key(s) fast"),
        (["--structured-outputs-config.reasoning_parser", "nope"], "unknown parser 'nope'"),
        (["--structured-outputs-compile-timeout", "0"], "must be positive"),
    ):
        error = usage_error(*words)
        assert message in error and "structured" in error, error
