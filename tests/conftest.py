import os
from pathlib import Path

# Triton's interpreter runs the Triton kernels on CPU tensors (tests/kernels). TRITON_INTERPRET is
# read when `triton.language` defines its own jitted helpers (tl.zeros, ...), i.e. at the first
# import of triton, which torch may do while any test module is collected (torch._dynamo imports
# it): set before pytest collects anything, or an interpreted kernel calls an uninterpreted helper.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

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


def fresh_cache_root(path: Path) -> Path:
    """`path` made a fresh SONAR_CACHE_ROOT that shares this machine's built native CPU kernels
    (its `native` folder links to the current cache root's): a process started on it loads the
    library instead of compiling cpu_ops.cpp again (over a minute on 2 cores); everything else in
    it (compile artifacts, converted weights) starts empty. Call it before pointing
    SONAR_CACHE_ROOT at `path`."""
    from sonar import paths

    native = paths.cache_root() / "native"
    native.mkdir(parents=True, exist_ok=True)
    path.mkdir(parents=True, exist_ok=True)
    (path / "native").symlink_to(native, target_is_directory=True)
    return path
