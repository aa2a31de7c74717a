"""``--data-parallel-backend ray``: every replica's worker placed by Ray over a real two-node Ray
cluster on this machine (`ray.cluster_utils.Cluster`: a head and a second raylet, two CPUs each;
for one-rank replicas a placement group holds one CPU of each node, so the two replicas' one-CPU
bundles cannot share a node and Ray puts one replica on each).

* The replica on the serving process's node has its worker on private ipc; the other's worker
  runs on the second node, listening at ``tcp://<its Ray address>:<master_port + replica>`` with
  the deployment's keys, and reaches the scheduler on this node over tcp. Both replicas serve
  requests, and the greedy texts are one engine's.
* tp = 2 replicas: one replica's group fits each node (``STRICT_PACK``); the other node's group,
  rank 0 included, listens on tcp there and meets at a rendezvous on that node's Ray address.
* SIGKILL of the other node's worker under 16 requests: the worker restarts (Ray places it on that
  node again, the only one with a free CPU) and recomputes them (or, not back within
  `WORKER_LOST_AFTER`, they move to the other replica, as a headless node's would); none fails,
  the texts are one engine's.
* What lays replicas out over machines by hand (headless nodes), another executor backend, and
  pipeline stages are refused by name (no Ray started).
"""

from __future__ import annotations

import os
import signal
import socket
from typing import Any, Iterator

import anyio
import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group, remove_placement_group

import sonar
from sonar.actors import keys
from sonar.actors.spec import RENDEZVOUS_HOST_ENV
from sonar.cli.parse import UsageError, parse_serve_args
from sonar.engine.client import _ran_elsewhere
from sonar.engine.config import EngineConfig
from sonar.sampling_params import SamplingParams
from tests.engine.conftest import TinyCheckpoint, greedy_texts
from tests.engine.test_ray_nodes import _environ, two_ray_nodes
from tests.http.conftest import free_port

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("one_thread")]

PROMPTS = [f"w{i} w{i + 7} w{2 * i + 1} w{i + 50}" for i in range(16)]
MAX_TOKENS = 100
"""Long enough that a kill lands while the requests run (the tiny model has 256 positions)."""
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
BASE: dict[str, Any] = {"dtype": "float32", "num_gpu_blocks_override": 64}
NODE: dict[str, Any] = {"num_cpus": 2, "object_store_memory": 80 * 2**20}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def reference(llama: TinyCheckpoint) -> list[str]:
    """One engine's greedy texts of `PROMPTS`."""
    return greedy_texts(llama.path, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Two Ray nodes of two CPUs each, this process joined at the head, and the deployment's actor
    keys (the second node's worker reads the same directory, as a copy at the same path on
    another machine)."""
    keys.configure(keys.keygen(tmp_path_factory.mktemp("ray-dp") / "keys"))
    try:
        yield from two_ray_nodes(NODE)
    finally:
        keys.configure(None)


@pytest.fixture
def one_cpu_per_node(cluster: Cluster) -> Iterator[None]:
    """One CPU of each node held by a placement group of the test's own, while the test runs:
    one-CPU replicas then cannot share a node."""
    hold = placement_group([{"CPU": 1}] * 2, strategy="STRICT_SPREAD")
    ray.get(hold.ready(), timeout=30)
    try:
        yield
    finally:
        remove_placement_group(hold)


def _ports(count: int) -> int:
    """A port P with P .. P + count - 1 all free (rank r of replica i listens at P + i x world + r)."""
    for _ in range(50):
        port = free_port()
        try:
            for offset in range(1, count):
                with socket.socket() as s:
                    s.bind(("", port + offset))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports")


def _workers(llm: Any, port: int) -> tuple[Any, Any]:
    """The worker of the replica on the serving process's node and that of the one on the other
    node, checked to be where the backend put them."""
    workers = [llm.replicas.engine(i).child("worker") for i in range(2)]
    assert {w.placement for w in workers} == {"ray"}
    local = [w for w in workers if w.address.startswith("ipc://")]
    remote = [w for w in workers if w.address.startswith("tcp://")]
    assert len(local) == len(remote) == 1, [w.address for w in workers]
    index = workers.index(remote[0])
    # rank 0 of replica i listens at --master-port + i x world size, on its node's Ray address
    assert remote[0].address == f"tcp://{ray.util.get_node_ip_address()}:{port + index}"
    live = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED" and g["name"]]
    assert len(live) == 2 and len({n for g in live for n in g["bundles_to_node_id"].values()}) == 2
    return local[0], remote[0]


@pytest.mark.usefixtures("one_cpu_per_node")
async def test_two_replicas_on_two_ray_nodes_serve_one_engines_texts(llama: TinyCheckpoint, reference) -> None:
    port = _ports(2)
    args = {**BASE, "data_parallel_size": 2, "data_parallel_backend": "ray", "master_port": port}
    async with sonar.open(str(llama.path), **args) as llm:
        assert llm.config.distributed_executor_backend == "ray"
        _, remote = _workers(llm, port)
        # a lost worker of the other node has its requests moved after WORKER_LOST_AFTER, as a headless node's
        workers = [llm.replicas.engine(i).child("worker") for i in range(2)]
        assert [_ran_elsewhere(llm.replicas, i) for i in range(2)] == [w is remote for w in workers]
        before = await llm.replica_stats()
        texts = [o.text for o in await llm.generate_many(PROMPTS, GREEDY)]
        after = await llm.replica_stats()
    assert texts == reference
    served = [a.prefix_queries - b.prefix_queries for a, b in zip(after, before)]
    assert all(n > 0 for n in served), served  # the replica on the other node computed prompts too


async def test_tp2_replicas_on_two_ray_nodes_serve_one_engines_texts(llama: TinyCheckpoint, reference, cluster) -> None:
    port = _ports(4)
    args = {**BASE, "data_parallel_size": 2, "tensor_parallel_size": 2, "data_parallel_backend": "ray"}
    async with sonar.open(str(llama.path), **args, master_port=port) as llm:
        groups = [llm.replicas.engine(i).child("worker").child for i in range(2)]
        ranks = [[g.child(f"rank{r}") for r in range(2)] for g in groups]
        # each replica's group on one node: one all on ipc, the other all on tcp there
        remote = [i for i in range(2) if ranks[i][0].address.startswith("tcp://")]
        assert len(remote) == 1, [[r.address for r in rs] for rs in ranks]
        (index,) = remote
        here = ray.util.get_node_ip_address()
        assert [r.address for r in ranks[index]] == [f"tcp://{here}:{port + 2 * index + r}" for r in range(2)]
        assert all(r.address.startswith("ipc://") for r in ranks[1 - index])
        # the remote group met on its rank 0's node, not on the serving node's loopback
        assert all(_environ(r.pid)[RENDEZVOUS_HOST_ENV] == here for r in ranks[index])
        before = await llm.replica_stats()
        texts = [o.text for o in await llm.generate_many(PROMPTS, GREEDY)]
        after = await llm.replica_stats()
    assert texts == reference
    assert all(a.prefix_queries > b.prefix_queries for a, b in zip(after, before))


@pytest.mark.slow
@pytest.mark.usefixtures("one_cpu_per_node")
async def test_a_killed_worker_on_the_other_node_restarts_and_no_request_fails(
    llama: TinyCheckpoint, reference
) -> None:
    port = _ports(2)
    args = {**BASE, "data_parallel_size": 2, "data_parallel_backend": "ray", "master_port": port}
    async with sonar.open(str(llama.path), **args) as llm:
        _, remote = _workers(llm, port)
        before = remote.pid
        results: dict[int, str] = {}

        async def one(i: int) -> None:
            results[i] = (await llm.generate(PROMPTS[i], GREEDY)).text

        index = [llm.replicas.engine(i).child("worker") for i in range(2)].index(remote)
        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(one, i)
            while llm.router.in_flight[index] == 0:
                await anyio.sleep(0.01)
            async for _ in llm.stream(PROMPTS[0], GREEDY):  # the replicas are decoding
                break
            os.kill(remote.pid, signal.SIGKILL)  # the worker's host on the second node
            assert len(results) < 16
        assert [results[i] for i in range(16)] == reference
        _, remote = _workers(llm, port)  # back on the second node
        assert remote.restarts == 1 and remote.pid != before


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            {"data_parallel_size_local": 1},
            "--data-parallel-size-local 1 is not supported with --data-parallel-backend ray",
        ),
        ({"data_parallel_address": "10.0.0.1"}, "--data-parallel-address 10.0.0.1 is not supported with"),
        ({"data_parallel_rpc_port": 13345}, "--data-parallel-rpc-port 13345 is not supported with"),
        ({"data_parallel_start_rank": 1}, "--data-parallel-start-rank 1 is not supported with"),
        (
            {"distributed_executor_backend": "mp"},
            "is --distributed-executor-backend ray; drop --distributed-executor-backend mp",
        ),
        ({"pipeline_parallel_size": 2}, "--pipeline-parallel-size 2 with --data-parallel-backend ray is not supported"),
        ({"data_parallel_backend": "slurm"}, "--data-parallel-backend must be 'mp' or 'ray', got 'slurm'"),
    ],
)
def test_layouts_that_ray_does_not_decide_are_refused_by_name(args: dict[str, Any], message: str) -> None:
    full = {"data_parallel_size": 2, "data_parallel_backend": "ray", **args}
    with pytest.raises(ValueError) as info:
        EngineConfig.from_args("x", **full)
    assert message in str(info.value)


def test_the_flags_of_headless_nodes_are_refused_on_the_command_line() -> None:
    config = parse_serve_args(["-dp", "2", "--data-parallel-backend", "ray"]).engine
    assert (config.data_parallel_backend, config.distributed_executor_backend) == ("ray", "ray")
    with pytest.raises(UsageError, match=r"argument --headless: not supported with --data-parallel-backend ray"):
        parse_serve_args(["-dp", "2", "--data-parallel-backend", "ray", "--headless"])
    with pytest.raises(UsageError, match=r"--nnodes 2 is not supported with --data-parallel-backend ray"):
        parse_serve_args(["-tp", "2", "--data-parallel-backend", "ray", "--nnodes", "2"])


def test_without_ray_the_backend_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sonar.engine.config.ray_installed", lambda: False)
    with pytest.raises(ValueError, match=r"--data-parallel-backend ray needs Ray: pip install sonar\[ray\]"):
        EngineConfig.from_args("x", data_parallel_size=2, data_parallel_backend="ray")


def test_a_replica_placed_by_ray_may_have_rank_0_on_another_node() -> None:
    from sonar.actors.spec import RayBundle
    from sonar.engine.replicas import data_parallel_spec, replica_config, replica_gpus

    config = EngineConfig.from_args("x", data_parallel_size=2, data_parallel_backend="ray", master_port=13000)
    tree = data_parallel_spec(config)
    placements = [next(c for c in replica.children if c.name == "worker").placement for replica in tree.children]
    assert placements == [
        RayBundle(0, 1, 900.0, port=13000, anywhere=True),
        RayBundle(0, 1, 900.0, port=13001, anywhere=True),
    ]
    # each replica's rank has a GPU of its own (its bundle's): the whole share of it, on its device 0;
    # the byte budget is shared as on one machine
    budgets = EngineConfig.from_args(
        "x", data_parallel_size=2, data_parallel_backend="ray", gpu_memory_utilization=0.8, kv_cache_memory_bytes=2**30
    )
    one = replica_config(budgets, 1)
    assert (one.gpu_memory_utilization, one.kv_cache_memory_bytes) == (0.8, 2**29)
    assert replica_gpus(one, device_count=1, own_gpu=True) == (0, 1)
    plain = EngineConfig.from_args("x", distributed_executor_backend="ray", master_port=13000)
    (worker, *_) = data_parallel_spec(plain).children
    assert worker.placement == RayBundle(0, 1, 900.0, port=13000)  # one engine's rank 0 stays on the serving node


def test_a_config_built_field_by_field_must_name_the_executor_backend() -> None:
    config = EngineConfig(model="x", data_parallel_size=2, data_parallel_backend="ray")
    with pytest.raises(ValueError, match=r"--data-parallel-backend ray needs distributed_executor_backend 'ray'"):
        config.check()
