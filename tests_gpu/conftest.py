"""GPU-only tests: the Triton kernels compiled for the device, at real model shapes.

Run by ``scripts/gpu_check`` (never by ``scripts/test``, which collects ``tests/`` only). Without a
CUDA device the session stops with an error instead of skipping: a GPU check that did not run is
not a pass.
"""

from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # before anything imports triton: compile, do not interpret

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    if not torch.cuda.is_available():
        raise pytest.UsageError("tests_gpu needs a CUDA GPU (torch.cuda.is_available() is False)")


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(0)
