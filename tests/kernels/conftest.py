"""The Triton kernels run on CPU tensors through Triton's interpreter in these tests.

``TRITON_INTERPRET`` is read when a kernel is defined (at import of ``sonar.kernels.triton``), so
it is set here, before any test module of this directory imports the kernels. Nothing outside
these tests imports ``sonar.kernels.triton`` on a CPU machine (``sonar.kernels.ops`` loads it
only for CUDA tensors), and ``test_triton_ops.py`` checks that the kernels really are interpreted.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"
