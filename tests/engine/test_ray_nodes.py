"""The ``ray`` executor backend over several Ray nodes (`sonar.actors.ray_runner`): a real two-node
Ray cluster on this machine (`ray.cluster_utils.Cluster`: a head and a second raylet, one CPU
each), so a tp = 2 group cannot fit one node and Ray spreads it (``PACK``, a bundle per node).

* Rank 0 runs on the serving process's node over private ipc; rank 1 on the other node listens
  at ``tcp://<its Ray address>:<master_port + 1>`` with the deployment's keys (a peer without
  them gets nothing from it); the group meets at a rendezvous on the head's Ray address; greedy
  tokens equal the single worker's.
* SIGKILL of the rank on the second node under 16 requests: the group restarts, spread again,
  and all 16 complete with the single worker's text.
"""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path
from typing import Any, Iterator

import anyio
import pytest
import ray
import zmq
from ray.cluster_utils import Cluster

import sonar
from sonar.actors import keys
from sonar.actors.host import HOST_NAME, Spawn
from sonar.actors.messages import ReplyTo
from sonar.actors.ray_runner import RayPlacementError, assign_bundles
from sonar.actors.spec import RENDEZVOUS_HOST_ENV
from sonar.sampling_params import SamplingParams
from tests.actors.test_security import message, raw_dealer, recv, stranger
from tests.engine.conftest import TinyCheckpoint
from tests.http.conftest import free_port

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("one_thread")]

TEXTS = ["w5 w17 w33 w2 w9", "w100 w250 w7", "w1 w2 w3 w4 w5 w6 w7 w8", "w42"]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [f"w{i} w{i + 7} w{2 * i + 1} w{i + 50}" for i in range(16)]
LONGER = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
BASE: dict[str, Any] = {"dtype": "float32", "num_gpu_blocks_override": 64}
NODE: dict[str, Any] = {"num_cpus": 1, "object_store_memory": 80 * 2**20}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The deployment's actor keys, this process's for the module (the second node's host reads
    the same directory, as a copy at the same path on another machine)."""
    root = keys.keygen(tmp_path_factory.mktemp("ray-nodes") / "keys")
    keys.configure(root)
    try:
        yield root
    finally:
        keys.configure(None)


def two_ray_nodes(node: dict[str, Any]) -> Iterator[Cluster]:
    """A real two-raylet Ray cluster, each node started with `node`'s arguments; this process
    joins at the head until the generator ends."""
    nodes = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    try:
        nodes.add_node(**node)
        nodes.wait_for_nodes()
        ray.init(address=nodes.address, log_to_driver=False)
        yield nodes
    finally:
        ray.shutdown()
        nodes.shutdown()


@pytest.fixture(scope="module")
def cluster(deployment: Path) -> Iterator[Cluster]:
    """Two Ray nodes of one CPU each; this process joins at the head."""
    yield from two_ray_nodes(NODE)


@pytest.fixture(scope="module")
async def single(llama: TinyCheckpoint, deployment: Path) -> tuple[list[list[int]], list[str]]:
    """The single worker's greedy tokens of `TEXTS` and texts of `PROMPTS`."""
    async with sonar.open(str(llama.path), **BASE) as llm:
        outputs = await llm.generate_many(TEXTS, GREEDY)
        longer = await llm.generate_many(PROMPTS, LONGER)
    return [o.token_ids for o in outputs], [o.text for o in longer]


def _master_port() -> int:
    """A port P with P + 1 free too (rank 1's host listens at --master-port + 1)."""
    for _ in range(50):
        port = free_port()
        try:
            with socket.socket() as s:
                s.bind(("", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def _spread(llm: Any) -> tuple[Any, Any]:
    """Rank 0 and rank 1 of the engine's group, checked to run on the two nodes."""
    group = llm.supervisor.child("worker").child
    rank0, rank1 = group.child("rank0"), group.child("rank1")
    here = ray.util.get_node_ip_address()
    assert rank0.address.startswith("ipc://")  # the fast local link, unchanged
    assert rank1.address.startswith(f"tcp://{here}:")
    (live,) = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    assert live["strategy"] == "PACK" and len(set(live["bundles_to_node_id"].values())) == 2
    return rank0, rank1


async def test_tp2_over_two_ray_nodes_equals_the_single_worker(
    llama: TinyCheckpoint, single: Any, cluster: Cluster
) -> None:
    args = {**BASE, "tensor_parallel_size": 2, "distributed_executor_backend": "ray", "master_port": _master_port()}
    async with sonar.open(str(llama.path), **args) as llm:
        greedy = [o.token_ids for o in await llm.generate_many(TEXTS, GREEDY)]
        rank0, rank1 = _spread(llm)
        assert rank1.address.endswith(f":{args['master_port'] + 1}")
        # the group met on the head's Ray address; no secret travelled through Ray to the other node
        here = ray.util.get_node_ip_address()
        assert _environ(rank0.pid)[RENDEZVOUS_HOST_ENV] == here
        remote = _environ(rank1.pid)
        assert not set(keys.INLINE) & set(remote) and remote[RENDEZVOUS_HOST_ENV] == here
        # the rank's host over tcp answers no one without the deployment's keys
        ctx = zmq.Context()
        try:
            sock = raw_dealer(ctx, rank1.address, stranger(), b"stranger")
            sock.send_multipart(message(HOST_NAME, Spawn(name="x", target="os:system"), ReplyTo("stranger", 1, None)))
            assert await recv(sock, 1.0) is None
            sock.close()
        finally:
            ctx.term()
    assert greedy == single[0]


@pytest.mark.slow
async def test_a_killed_rank_on_the_other_node_restarts_the_group_and_no_request_fails(
    llama: TinyCheckpoint, single: Any, cluster: Cluster
) -> None:
    args = {
        **BASE,
        "num_gpu_blocks_override": 24,  # too small for all 16 at once: preemption and recompute too
        "tensor_parallel_size": 2,
        "distributed_executor_backend": "ray",
        "master_port": _master_port(),
    }
    async with sonar.open(str(llama.path), **args) as llm:
        rank0, rank1 = _spread(llm)
        before = (rank0.pid, rank1.pid)
        results: dict[int, str] = {}

        async def one(i: int) -> None:
            results[i] = (await llm.generate(PROMPTS[i], LONGER)).text

        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(one, i)
            async for _ in llm.stream(PROMPTS[0], LONGER):  # the batch is decoding
                break
            os.kill(rank1.pid, signal.SIGKILL)  # the rank's host on the second node
            assert len(results) < 16
        assert [results[i] for i in range(16)] == single[1]
        rank0, rank1 = _spread(llm)  # placed over both nodes again
        assert rank1.restarts == 1 and before[0] != rank0.pid and before[1] != rank1.pid


def test_ranks_take_the_serving_nodes_bundles_first() -> None:
    assert assign_bundles({0: "b", 1: "a", 2: "b", 3: "a"}, here="a") == [1, 3, 0, 2]
    assert assign_bundles({0: "a", 1: "a"}, here="a") == [0, 1]


async def test_a_spread_group_without_the_deployments_keys_is_refused_by_name(cluster: Cluster) -> None:
    """Ephemeral keys (none configured): the rank Ray puts on the second node could not be
    reached, so the start fails naming the keys; the placement group goes. A runtime-level test
    (sample actors, no model)."""
    from sonar.actors import ChildSpec, SupervisorSpec, supervise
    from sonar.actors.spec import RayBundle
    from tests.actors.sample import SampleMsg

    port = _master_port()
    children = [
        ChildSpec(f"r{r}", "tests.actors.sample:Sample", protocol=SampleMsg, placement=RayBundle(r, 2, port=port + r))
        for r in range(2)
    ]
    spec = SupervisorSpec("root", [SupervisorSpec("group", children, start_together=True)])
    keys.configure(keys.Credentials.generate())
    try:
        with pytest.raises(RayPlacementError, match=r"rank 1 on another node .*deployment's keys.*--actor-keys"):
            async with supervise(spec):
                pass
    finally:
        keys.configure(None)
    assert all(g["state"] == "REMOVED" for g in ray.util.placement_group_table().values())


def test_a_master_port_whose_rank_ports_run_past_the_last_port_is_refused() -> None:
    from sonar.engine.config import EngineConfig

    config = EngineConfig(model="x", tensor_parallel_size=2, distributed_executor_backend="ray", master_port=65535)
    with pytest.raises(ValueError, match=r"master_port 65535: .* up to 65536, which must be a port"):
        config.check_parallel()
