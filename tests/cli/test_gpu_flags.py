"""The GPU runner's flags: parsed values land in `EngineConfig`, bad ones are one-line errors."""

from __future__ import annotations

from sonar.cli import parse_serve_args


def test_gpu_flags_reach_the_engine() -> None:
    engine = parse_serve_args(
        [
            "--gpu-memory-utilization",
            "0.5",
            "--kv-cache-dtype",
            "fp8",
            "--cudagraph-capture-sizes",
            "4",
            "1",
            "2",
            "--max-cudagraph-capture-size",
            "4",
            "--device-ids",
            "1",
            "--enforce-eager",
        ]
    ).engine
    assert engine.gpu_memory_utilization == 0.5
    assert engine.kv_cache_dtype == "fp8"
    assert list(engine.cudagraph_capture_sizes) == [4, 1, 2]
    assert engine.max_cudagraph_capture_size == 4
    assert engine.device_ids == "1"
    assert engine.enforce_eager
    assert parse_serve_args(["-gmu", "0.7"]).gpu_memory_utilization == 0.7
    for value in ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3"):
        assert parse_serve_args(["--kv-cache-dtype", value]).engine.kv_cache_dtype == value


def test_bad_gpu_flag_values_are_one_line(usage_error) -> None:
    assert usage_error("--cudagraph-capture-sizes", "0", "4") == (
        "sonar serve: error: cudagraph_capture_sizes must be positive integers, got [0, 4]"
    )
    assert usage_error("--max-cudagraph-capture-size", "0").startswith(
        "sonar serve: error: argument --max-cudagraph-capture-size: "
    )
    assert usage_error("--device-ids", "0,1").startswith(
        "sonar serve: error: device_ids '0,1': Sonar serves from one device"
    )
    assert usage_error("--kv-cache-dtype", "fp8", "--kv-offloading-size", "4") == (
        "sonar serve: error: KV offloading with kv_cache_dtype fp8 is not supported yet (the offload tiers "
        "store the model's dtype); drop one of the two"
    )


def test_optimization_level_reaches_the_engine(usage_error) -> None:
    """-O0 (nothing compiled, no graphs) to -O3 (compile on the CPU too); the default is 2."""
    assert parse_serve_args([]).engine.optimization_level == 2
    for argv, level in ((["-O0"], 0), (["-O", "1"], 1), (["--optimization-level", "3"], 3), (["-O3"], 3)):
        assert parse_serve_args(argv).engine.optimization_level == level
    assert "argument --optimization-level/-O: invalid choice: 4" in usage_error("-O4")
