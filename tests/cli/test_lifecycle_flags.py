"""--weight-transfer-config and --api-server-count at parse time: what starts, what is refused and
how the refusal reads."""

from __future__ import annotations

from sonar.cli import parse_serve_args


def test_weight_transfer_config_reaches_the_engine_and_refuses_group_backends(usage_error) -> None:
    config = parse_serve_args(["--weight-transfer-config", '{"backend": "sonar", "max_update_bytes": 1000}'])
    assert config.engine.weight_transfer().max_update_bytes == 1000
    assert parse_serve_args(["--weight-transfer-config.backend", "sonar"]).engine.weight_transfer().backend == "sonar"
    assert parse_serve_args([]).engine.weight_transfer() is None
    assert "backend 'nccl'" in usage_error("--weight-transfer-config", '{"backend": "nccl"}')
    assert "backend 'ipc'" in usage_error("--weight-transfer-config.backend", "ipc")
    assert "max_update_bytes must be positive" in usage_error("--weight-transfer-config.max_update_bytes", "0")


def test_api_server_count_starts_more_api_servers_and_refuses_what_one_server_holds(usage_error) -> None:
    assert parse_serve_args([]).api_server_count is None
    assert parse_serve_args(["-asc", "1"]).api_server_count == 1
    assert parse_serve_args(["--api-server-count", "3", "--max-stored-responses", "0"]).api_server_count == 3
    assert "must be positive" in usage_error("--api-server-count", "0")
    two = ("--api-server-count", "2", "--max-stored-responses", "0")
    assert "--max-stored-responses 0" in usage_error("--api-server-count", "2")
    for flags, named in [
        (("--enable-lora",), "--enable-lora"),
        (("-dp", "2"), "--data-parallel-size"),
        (("--enable-sleep-mode",), "--enable-sleep-mode"),
        (("--weight-transfer-config", '{"backend": "sonar"}'), "--weight-transfer-config"),
        (("--uds", "/tmp/sonar.sock"), "--uds"),
        (("--port", "0"), "--port 0"),
    ]:
        message = usage_error(*two, *flags)
        assert message.startswith(
            "sonar serve: error: argument --api-server-count: 2 API servers cannot run with " + named
        )
