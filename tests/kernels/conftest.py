"""The Triton kernels run on CPU tensors through Triton's interpreter in these tests:
``TRITON_INTERPRET`` is set by tests/conftest.py before anything imports triton. Nothing outside
these tests imports ``sonar.kernels.triton`` on a CPU machine (``sonar.kernels.ops`` loads it
only for CUDA tensors), and ``test_triton_ops.py`` checks that the kernels really are interpreted.
"""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from sonar.kernels import native


@pytest.fixture
def native_built() -> None:
    """Native cases fail, not skip, where the native kernels did not build."""
    assert native.available(), "the native kernels did not build here"


#: The paths of the linear kernels (bfloat16 and quantized) this CPU runs, slowest first.
RUNNABLE = native.ISAS[: native.ISAS.index(native.best_isa(native.cpu_flags())) + 1]


@pytest.fixture(params=RUNNABLE)
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each path of the linear kernels this CPU runs, forced for the test (the others are refused:
    ``test_quant_cpu.py``'s `test_a_path_the_cpu_cannot_run_is_refused`)."""
    native.set_quant_isa(request.param)
    try:
        yield request.param
    finally:
        native.set_quant_isa("auto")


#: ``-mno-avx512f``: the build a CPU without AVX-512 gets. ``-O1`` (after the product's ``-O3``, so
#: it wins) takes about 60 % of ``-O3``'s compile time (22 s against 37 s of CPU); the same code
#: paths run (the plain loops, the AVX2 path its target attribute compiles in), less optimized.
#: The trade-off: a fault only ``-O3`` would bring out in the plain element-wise loops (undefined
#: behaviour it exploits) goes unseen here; the portable quantized path still runs at ``-O3`` in
#: the default build (`tests/kernels/test_quant_cpu.py`'s `isa` fixture), and what users build is
#: unchanged.
PORTABLE_FLAGS = ("-mno-avx512f", "-O1")


@pytest.fixture(scope="session")
def portable_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The kernels built as a CPU without AVX-512 gets them (``-mno-avx512f``: the plain C++
    loops; at ``-O1``: `PORTABLE_FLAGS`), compiled fresh for this run into a folder the run's test
    processes share: one build (about 25 s of CPU), the other process waits on `native.build`'s
    lock and loads it."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    return native.build(shared / "portable-kernels", flags=PORTABLE_FLAGS)
