"""The engine settings checked without torch: the KV cache dtypes they accept are the ones the
worker maps to torch dtypes, and the server's flags and supervision tree import no torch."""

import subprocess
import sys

import pytest

from sonar.engine import memory
from sonar.engine.settings import KV_CACHE_DTYPE_NAMES


def test_kv_cache_dtype_names_are_the_workers() -> None:
    assert set(KV_CACHE_DTYPE_NAMES) == set(memory.KV_CACHE_DTYPES)


def test_flags_and_tree_need_no_torch() -> None:
    """What `sonar serve` runs before it starts the worker process: parsing every default and
    building the supervision tree (the worker's torch import then runs beside this process's)."""
    code = (
        "import sys\n"
        "from sonar.cli.parse import parse_serve_args\n"
        "from sonar.cli.serve import root_spec\n"
        "root_spec(parse_serve_args(['--kv-cache-dtype', 'fp8']))\n"
        "root_spec(parse_serve_args(['--kv-offloading-size', '1']))\n"
        "from sonar.engine.config import ray_installed\n"
        "if ray_installed():  # the ray backend's tree (Ray imported, not torch)\n"
        "    root_spec(parse_serve_args(['-tp', '2', '--distributed-executor-backend', 'ray']))\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_ray_backend_without_ray_is_refused_with_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from sonar.cli.errors import UsageError
    from sonar.cli.parse import parse_serve_args

    monkeypatch.setitem(sys.modules, "ray", None)  # what an environment without Ray imports
    with pytest.raises(UsageError, match=r"'ray' needs Ray: pip install sonar\[ray\]"):
        parse_serve_args(["-tp", "2", "--distributed-executor-backend", "ray"])


def test_the_ray_backend_takes_no_remote_worker_placement() -> None:
    from sonar.engine.config import EngineConfig, ray_installed

    assert ray_installed(), "the test extra installs Ray"
    with pytest.raises(ValueError, match="'ray' places the workers itself"):
        EngineConfig.from_args(None, distributed_executor_backend="ray", placement="worker=tcp://10.0.0.1:5000")
