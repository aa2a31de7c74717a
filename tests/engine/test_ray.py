"""The ``ray`` executor backend (`sonar.actors.ray_runner`): the ranks of a tensor-parallel group
placed by a real local Ray runtime, which the module starts (2 CPUs, a small object store, no
dashboard).

* tp = 2 through ``distributed_executor_backend="ray"`` gives the single worker's greedy tokens,
  through the library and through one HTTP server (``sonar serve`` joining the test's runtime by
  ``RAY_ADDRESS``); each rank's process is a child of a Ray actor in one bundle of the group's
  placement group, which closing the engine removes.
* A rank's Ray actor process SIGKILLed mid-stream (as `ray.kill` does): the group restarts in a new
  placement group and all 16 requests complete with the single worker's text.
* Without Ray installed the backend is refused with the extra to install (tests/engine/test_settings.py).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any, Iterator

import anyio
import httpx
import pytest
import ray  # noqa: E402  (the test extra installs it: these tests fail, not skip, without it)

import sonar
from sonar.sampling_params import SamplingParams
from tests.engine.conftest import TinyCheckpoint
from tests.http.conftest import serving

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("one_thread")]

TEXTS = ["w5 w17 w33 w2 w9", "w100 w250 w7", "w1 w2 w3 w4 w5 w6 w7 w8", "w42"]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [f"w{i} w{i + 7} w{2 * i + 1} w{i + 50}" for i in range(16)]
LONGER = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
BASE: dict[str, Any] = {"dtype": "float32", "num_gpu_blocks_override": 64}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def ray_runtime() -> Iterator[str]:
    """A local Ray runtime for the module; its address (for a server to join)."""
    ray.init(num_cpus=2, object_store_memory=80 * 2**20, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
async def single(llama: TinyCheckpoint) -> tuple[list[list[int]], list[str], list[str]]:
    """The single worker's greedy tokens and texts of `TEXTS`, and its texts of `PROMPTS`."""
    async with sonar.open(str(llama.path), **BASE) as llm:
        outputs = await llm.generate_many(TEXTS, GREEDY)
        longer = await llm.generate_many(PROMPTS, LONGER)
    return [o.token_ids for o in outputs], [o.text for o in outputs], [o.text for o in longer]


def _groups() -> list[dict[str, Any]]:
    return [g for g in ray.util.placement_group_table().values() if g["name"].startswith("sonar-")]


async def test_tp2_on_ray_equals_the_single_worker(llama: TinyCheckpoint, single: Any, ray_runtime: str) -> None:
    async with sonar.open(str(llama.path), **BASE, tensor_parallel_size=2, distributed_executor_backend="ray") as llm:
        greedy = [o.token_ids for o in await llm.generate_many(TEXTS, GREEDY)]
        group = llm.supervisor.child("worker").child
        assert [r.placement for r in group.runners] == ["ray", "ray"]
        keepers = [r.proc.keeper for r in group.runners]
        # each rank's process is the child of its Ray actor, one bundle each of one placement group
        for runner, keeper in zip(group.runners, keepers):
            keeper_pid = await keeper.pid.remote()
            assert _parent_pid(runner.pid) == keeper_pid
        (live,) = [g for g in _groups() if g["state"] == "CREATED"]
        assert live["bundles"] == {0: {"CPU": 1.0}, 1: {"CPU": 1.0}} and live["strategy"] == "STRICT_PACK"
    assert greedy == single[0]
    assert all(g["state"] == "REMOVED" for g in _groups())
    for keeper in keepers:  # the Ray actors went with the engine
        with pytest.raises(ray.exceptions.RayActorError):
            await keeper.pid.remote()


@pytest.mark.slow
async def test_a_killed_rank_restarts_the_group_and_no_request_fails(
    llama: TinyCheckpoint, single: Any, ray_runtime: str
) -> None:
    """SIGKILL of rank 1's Ray actor process (what `ray.kill` does too): its host follows it down,
    the group restarts in a new placement group; the texts are the single worker's."""
    # a cache too small for all 16 at once: requests are preempted and recomputed as well
    args = {**BASE, "num_gpu_blocks_override": 24, "tensor_parallel_size": 2, "distributed_executor_backend": "ray"}
    async with sonar.open(str(llama.path), **args) as llm:
        group = llm.supervisor.child("worker").child
        before = {r.name: r.pid for r in group.runners}
        results: dict[int, str] = {}

        async def one(i: int) -> None:
            results[i] = (await llm.generate(PROMPTS[i], LONGER)).text

        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(one, i)
            async for _ in llm.stream(PROMPTS[0], LONGER):  # the batch is decoding
                break
            keeper = group.child("rank1").proc.keeper
            os.kill(await keeper.pid.remote(), signal.SIGKILL)
            assert len(results) < 16  # killed with requests in flight
        assert [results[i] for i in range(16)] == single[2]
        after = {r.name: r.pid for r in group.runners}
        assert all(after[name] != pid for name, pid in before.items())  # the whole group restarted
        assert group.child("rank1").restarts == 1
        (live,) = [g for g in _groups() if g["state"] == "CREATED"]  # the first one went with its runs
    assert all(g["state"] == "REMOVED" for g in _groups())


@pytest.mark.slow
async def test_a_server_with_ray_ranks_answers_as_the_single_worker(
    llama: TinyCheckpoint, single: Any, ray_runtime: str, tmp_path: Path
) -> None:
    args = (str(llama.path), "--dtype", "float32", "--num-gpu-blocks-override", "64", "-tp", "2")
    with serving(tmp_path, *args, "--distributed-executor-backend", "ray", env={"RAY_ADDRESS": ray_runtime}) as srv:
        for text, want in zip(TEXTS, single[1]):
            body = {"model": str(llama.path), "prompt": text, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
            reply = httpx.post(f"{srv.base_url}/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == want
        assert "ray.rank_placed" in srv.log() + srv.out()


def _parent_pid(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[1])


async def test_a_group_ray_cannot_place_fails_its_start_naming_what_is_free(ray_runtime: str) -> None:
    """Three one-CPU bundles on the module's two-CPU runtime (a runtime-level test: it shares the
    module's Ray runtime rather than start another)."""
    from sonar.actors import ChildSpec, SupervisorSpec, supervise
    from sonar.actors.ray_runner import RayPlacementError
    from sonar.actors.spec import RayBundle
    from tests.actors.sample import SampleMsg

    children = [
        ChildSpec(f"r{r}", "tests.actors.sample:Sample", protocol=SampleMsg, placement=RayBundle(r, 3, place_timeout=2))
        for r in range(3)
    ]
    spec = SupervisorSpec("root", [SupervisorSpec("group", children, start_together=True)])
    with pytest.raises(RayPlacementError, match=r"did not place 3 bundles .* free"):
        async with supervise(spec):
            pass
    assert all(g["state"] == "REMOVED" for g in _groups())
