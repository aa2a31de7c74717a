"""The Triton kernels run on CPU tensors through Triton's interpreter in these tests.

``TRITON_INTERPRET`` is read when a kernel is defined (at import of ``sonar.kernels.triton``), so
it is set here, before any test module of this directory imports the kernels. Nothing outside
these tests imports ``sonar.kernels.triton`` on a CPU machine (``sonar.kernels.ops`` loads it
only for CUDA tensors), and ``test_triton_ops.py`` checks that the kernels really are interpreted.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"


import pytest  # noqa: E402  (after TRITON_INTERPRET, which must be set before anything imports triton)

from sonar.kernels import native  # noqa: E402


@pytest.fixture
def native_built() -> None:
    """Native cases fail, not skip, where the native kernels did not build."""
    assert native.available(), "the native kernels did not build here"
