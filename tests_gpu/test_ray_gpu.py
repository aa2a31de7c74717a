"""The ``ray`` executor backend on GPUs: each rank's bundle holds one GPU, Ray's
``CUDA_VISIBLE_DEVICES`` leaves the rank that one (``SONAR_OWN_GPU``: it takes ``cuda:0``), and
NCCL runs between the ranks. One worker on Ray needs one GPU; tp = 2 needs two. Greedy tokens
equal the single in-process worker's."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import sonar
from tests_gpu.test_tensor_parallel_gpu import TEXTS, checkpoint  # noqa: F401  (a fixture)

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.anyio]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def ray_runtime() -> Iterator[None]:
    ray.init(num_cpus=4, num_gpus=torch.cuda.device_count(), include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


async def _greedy(monkeypatch: pytest.MonkeyPatch, path: Path, **args: Any) -> list[list[int]]:
    monkeypatch.setenv("SONAR_DEVICE", "cuda")
    params = sonar.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    async with sonar.open(str(path), dtype="float32", num_gpu_blocks_override=128, **args) as llm:
        return [o.token_ids for o in await llm.generate_many(TEXTS, params)]


@pytest.mark.parametrize(
    "tp",
    [
        1,
        pytest.param(2, marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tp = 2 needs two GPUs")),
    ],
)
async def test_ray_ranks_on_their_own_gpus_equal_one_worker(
    monkeypatch: pytest.MonkeyPatch,
    checkpoint: Path,  # noqa: F811
    ray_runtime: None,
    tp: int,
) -> None:
    want = await _greedy(monkeypatch, checkpoint)
    got = await _greedy(monkeypatch, checkpoint, tensor_parallel_size=tp, distributed_executor_backend="ray")
    assert got == want
    groups = [g for g in ray.util.placement_group_table().values() if g["name"].startswith("sonar-")]
    assert groups and all(b.get("GPU") == 1.0 for g in groups for b in g["bundles"].values())
