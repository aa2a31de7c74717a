"""The Triton kernels run on CPU tensors through Triton's interpreter in these tests:
``TRITON_INTERPRET`` is set by tests/conftest.py before anything imports triton. Nothing outside
these tests imports ``sonar.kernels.triton`` on a CPU machine (``sonar.kernels.ops`` loads it
only for CUDA tensors), and ``test_triton_ops.py`` checks that the kernels really are interpreted.
"""

import pytest

from sonar.kernels import native


@pytest.fixture
def native_built() -> None:
    """Native cases fail, not skip, where the native kernels did not build."""
    assert native.available(), "the native kernels did not build here"
