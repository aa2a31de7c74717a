import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture
def anyio_backend():
    """Sonar runs on anyio's asyncio backend (pyzmq's asyncio integration needs it)."""
    return "asyncio"


@pytest.fixture(scope="module")
def one_thread():
    """Run torch with one intra-op thread (here and, through OMP_NUM_THREADS, in spawned actor
    processes) while a module runs; restored afterwards.

    On the 2-vCPU test VM a two-thread OpenMP region can stall for milliseconds waiting for a
    core that another process holds: a decode step of the embedded model took ~250 ms instead of
    ~65 ms, a tiny-model step 100+ ms instead of 3 ms. Results do not depend on the thread count.
    """
    import torch

    before = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(before)
