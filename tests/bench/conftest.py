"""Shared by the `python -m sonar bench ...` smoke tests: small server flags and report checks."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

#: A small, fast server: float32 (exact on any CPU), a 256 MiB KV cache, short contexts.
SERVER_ARGS = ("--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory-bytes", "256M", "--seed", "0")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module", autouse=True)
def one_thread_servers():
    """Servers started by the bench commands run torch with one intra-op thread (see
    tests/conftest.py: two-thread OpenMP regions stall on a 2-vCPU machine)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield


def assert_png(path: Path) -> None:
    assert path.is_file(), f"{path} was not written"
    assert path.read_bytes()[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert path.stat().st_size > 5000, "the plot is suspiciously small"


def assert_ordered(result: dict[str, Any], metric: str, percentiles: list[str]) -> None:
    """median <= each listed percentile, in increasing order; a positive mean."""
    values = [result[f"median_{metric}_ms"]] + [result[f"{p}_{metric}_ms"] for p in percentiles]
    assert all(v >= 0 for v in values), (metric, values)
    assert values == sorted(values), f"{metric} percentiles out of order: {values}"
    assert result[f"mean_{metric}_ms"] > 0, metric


def env_of_subprocess() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
