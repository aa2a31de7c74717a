"""What of `scripts/gpu_check` a CPU can run: the script stops cleanly without a GPU, its modules
import, and the model-decode benchmark's helpers work on a small model.

`tests_gpu.bench_kernels` imports the Triton kernels for a GPU (not interpreted), which would
break the interpreter tests of tests/kernels in this process: it runs in a subprocess here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sonar.models.registry import model_class
from tests_gpu import bench_decode

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the script would run it")
def test_gpu_check_exits_2_without_a_cuda_device(tmp_path: Path) -> None:
    run = subprocess.run(
        [str(ROOT / "scripts" / "gpu_check")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "GPU_CHECK_OUT": str(tmp_path)},
    )
    assert run.returncode == 2, run.stderr
    assert "no Python here has torch with a CUDA device and triton" in run.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the benchmark would run")
def test_benchmark_imports_and_refuses_without_cuda() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "tests_gpu.bench_kernels", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().endswith("bench_kernels: no CUDA device")


def test_qwen3_06b_config_has_the_published_size(tmp_path: Path) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(bench_decode.write_config(tmp_path)))
    with torch.device("meta"):
        model = model_class(config)(config)
    assert 0.59e9 < sum(p.numel() for p in model.parameters()) < 0.61e9  # the tied embedding once
    assert bench_decode.weight_bytes(model.to(torch.bfloat16)) == 2 * sum(p.numel() for p in model.parameters())


def test_decode_timing_runs_on_cpu(tmp_path: Path) -> None:
    config = dict(
        bench_decode.QWEN3_06B_CONFIG,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=384,
        max_position_embeddings=512,
    )
    bench_decode.write_config(tmp_path, config)
    runner = bench_decode.dummy_runner(
        tmp_path, enforce_eager=True, dtype="float32", max_model_len=512, kv_cache_memory_bytes=2**20
    )
    assert runner.graphs is None  # CPU: no graphs
    seconds = bench_decode.decode_step_seconds(runner, steps=3, graphs=True)
    assert 0 < seconds < 5
