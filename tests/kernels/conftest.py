"""The Triton kernels run on CPU tensors through Triton's interpreter in these tests:
``TRITON_INTERPRET`` is set by tests/conftest.py before anything imports triton. Nothing outside
these tests imports ``sonar.kernels.triton`` on a CPU machine (``sonar.kernels.ops`` loads it
only for CUDA tensors), and ``test_triton_ops.py`` checks that the kernels really are interpreted.
"""

import os
from pathlib import Path

import pytest

from sonar.kernels import native


@pytest.fixture
def native_built() -> None:
    """Native cases fail, not skip, where the native kernels did not build."""
    assert native.available(), "the native kernels did not build here"


PORTABLE_FLAGS = ("-mno-avx512f",)


@pytest.fixture(scope="session")
def portable_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The kernels built as a CPU without AVX-512 gets them (``-mno-avx512f``: the plain C++
    loops), compiled fresh for this run into a folder the run's test processes share: one build
    (about a minute on 2 cores), the other process waits on `native.build`'s lock and loads it."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    return native.build(shared / "portable-kernels", flags=PORTABLE_FLAGS)
