import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture
def anyio_backend():
    """Sonar runs on anyio's asyncio backend (pyzmq's asyncio integration needs it)."""
    return "asyncio"
