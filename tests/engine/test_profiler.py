"""``--profiler-config`` (`sonar.engine.profiler`): what the flag accepts and refuses, and torch's
profiler started, stepped and stopped as the worker does (here in this thread, a real
`torch.profiler` around real operators). The routes on a server: `tests/http/test_admin.py`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import sonar
from sonar.cli import UsageError, parse_serve_args
from sonar.engine.config import EngineConfig
from sonar.engine.profiler import ProfilerConfig, TraceProfiler


def test_the_dotted_flag_reaches_the_engine(tmp_path: Path) -> None:
    argv = ["--profiler-config.profiler", "torch", "--profiler-config.torch_profiler_dir", str(tmp_path)]
    config = parse_serve_args([*argv, "--profiler-config.max_iterations", "3"]).engine
    profiler = config.profiler()
    assert profiler.torch_profiler_dir == str(tmp_path) and profiler.max_iterations == 3
    assert parse_serve_args([]).engine.profiler() is None  # off by default
    with pytest.raises(UsageError, match="--profiler-config.profiler cuda .* is not supported yet; use torch"):
        parse_serve_args(["--profiler-config.profiler", "cuda"])


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"profiler": "cuda"}, "profiler cuda (an Nsight capture range) is not supported yet"),
        ({"profiler": "nsys"}, "profiler must be torch, cuda or none"),
        ({"profiler": "torch"}, "needs torch_profiler_dir"),
        ({"profiler": "torch", "torch_profiler_dir": "gs://bucket/x"}, "a URI is not supported yet"),
        ({"torch_profiler_dir": "/tmp/x"}, "torch_profiler_dir is set but profiling is off: add profiler torch"),
        ({"profiler": "torch", "torch_profiler_dir": "/tmp/x", "active_iterations": 2}, "a profiler schedule"),
        ({"profiler": "torch", "torch_profiler_dir": "/tmp/x", "ignore_frontend": True}, "ignore_frontend"),
        ({"profiler": "torch", "torch_profiler_dir": "/tmp/x", "max_iterations": -1}, "must not be negative"),
        ({"profiler": "torch", "torch_profiler_dir": "/tmp/x", "with_stack": True}, "unknown field"),
    ],
)
def test_what_sonar_does_not_do_is_refused_at_startup(raw: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        EngineConfig.from_args(profiler_config=raw)
    assert message in str(info.value)


def test_sleep_mode_refuses_what_it_does_not_support_yet() -> None:
    with pytest.raises(ValueError, match=r"sleep mode .* with 2 worker ranks .* is not supported yet"):
        EngineConfig.from_args(enable_sleep_mode=True, tensor_parallel_size=2, distributed_executor_backend="mp")
    with pytest.raises(ValueError, match=r"sleep mode .* with LoRA adapters"):
        EngineConfig.from_args(enable_sleep_mode=True, enable_lora=True)
    assert EngineConfig.from_args(enable_sleep_mode=True).enable_sleep_mode


def work(steps: int, profiler: TraceProfiler) -> list[str]:
    """`steps` steps of matrix products, the profiler stepped after each; the files it wrote."""
    written = []
    a = torch.randn(32, 32)
    for _ in range(steps):
        torch.nn.functional.linear(a, a)
        written += profiler.step()
    return written


def trace_names(path: str) -> list[str]:
    with open(path) as f:
        return [e.get("name", "") for e in json.load(f)["traceEvents"]]


def test_the_trace_holds_the_operators_of_the_steps(tmp_path: Path) -> None:
    config = ProfilerConfig.parse({"profiler": "torch", "torch_profiler_dir": str(tmp_path / "out"),
                                   "torch_profiler_use_gzip": False, "torch_profiler_record_shapes": True})  # fmt: skip
    profiler = TraceProfiler(config, "worker0", "cpu")
    profiler.start()
    assert profiler.running
    work(3, profiler)
    trace, table = profiler.stop()
    assert not profiler.running and trace.endswith(".pt.trace.json") and table.endswith(".ops.txt")
    assert trace_names(trace).count("aten::linear") == 3
    assert "aten::linear" in Path(table).read_text()


def test_delay_and_max_iterations_choose_the_steps_recorded(tmp_path: Path) -> None:
    config = ProfilerConfig.parse(
        {
            "profiler": "torch",
            "torch_profiler_dir": str(tmp_path),
            "torch_profiler_use_gzip": False,
            "torch_profiler_dump_cuda_time_total": False,
            "delay_iterations": 2,
            "max_iterations": 3,
        }
    )
    profiler = TraceProfiler(config, "worker0", "cpu")
    profiler.start()
    assert work(4, profiler) == []  # 2 steps of delay, then 2 recorded
    assert profiler.running
    [trace] = work(2, profiler)  # the third recorded step stops it and writes the trace
    assert not profiler.running and trace_names(trace).count("aten::linear") == 3
    assert profiler.stop() == []
    profiler.start()
    assert profiler.stop() == []  # stopped during its delay: nothing recorded, no file


@pytest.mark.anyio
async def test_an_in_process_worker_traces_its_steps(tiny_engine_checkpoints, tmp_path: Path, one_thread) -> None:
    path = tiny_engine_checkpoints["llama3"].path
    profiler = {"profiler": "torch", "torch_profiler_dir": str(tmp_path), "torch_profiler_use_gzip": False}
    async with sonar.open(str(path), dtype="float32", num_gpu_blocks_override=32, profiler_config=profiler) as llm:
        await llm.start_profile()
        await llm.generate("w1 w2 w3", sonar.SamplingParams(temperature=0, max_tokens=4))
        files = await llm.stop_profile()
        assert await llm.stop_profile() == []
    [trace] = [f for f in files if f.endswith(".pt.trace.json")]
    assert Path(trace).name.startswith("sonar-worker0-rank0-")
    names = trace_names(trace)
    assert any("sonar/models/" in name and "forward" in name for name in names)
