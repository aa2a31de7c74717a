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


def test_api_server_count_above_one_is_refused_with_the_reason(usage_error) -> None:
    assert parse_serve_args(["--api-server-count", "1"]) is not None
    message = usage_error("--api-server-count", "2")
    assert "--api-server-count is not supported yet" in message and "engine client" in message
