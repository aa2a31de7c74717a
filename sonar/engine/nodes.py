"""A parallel group over several machines without Ray (``--nnodes``, ``--node-rank``,
``--master-addr``, ``--master-port``): which node runs which rank, and where the head finds them.

The world's ``tp x pp`` ranks are split evenly and in order: node ``k`` runs ranks
``k * per_node .. (k + 1) * per_node - 1``. Node 0, the *head*, runs the API server, the scheduler
and its ranks (rank 0 among them) as child processes; every other node runs ``sonar serve
--headless``, an agent (`sonar.engine.node_agent`) that keeps one actor host listening per rank of
its own, at ``tcp://<its address>:<master_port + rank>`` (CURVE, the deployment's keys). The head's
one-for-all group supervisor spawns those ranks there (`Remote` placements), so the group is
supervised in one place, as on one machine.

Both sides meet at torch's rendezvous store on ``master_addr:master_port``, which the head holds
for its lifetime: each headless node writes its address under `node_key`, the head waits for them
all, and each incarnation of the group meets under a prefix of its own there (`JoinGroup.prefix`).
Data-parallel replicas go over several machines the same way (``--data-parallel-size-local``,
``--data-parallel-start-rank``, ``--data-parallel-address``, ``--data-parallel-rpc-port``): the
head runs the API server, the router and every replica's scheduler and detokenizer, and the workers
of its own replicas (``0 .. size_local - 1``) as child processes; a headless node keeps one actor
host per rank of each replica of its own, at ``tcp://<its address>:<rpc_port + replica * world +
rank>`` (``world = tp x pp``; one rank: ``rpc_port + replica``), where the replica's engine
supervisor on the head spawns that rank's worker (model shards, KV cache, the compute); a replica's
ranks all run on its node, and meet there. The head's store at
``data_parallel_address:data_parallel_rpc_port`` is where the nodes report (`replica_key`).

This module decides; it opens nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from sonar.actors.spec import Remote

if TYPE_CHECKING:
    from sonar.actors.spec import Placement
    from sonar.engine.config import EngineConfig

HEAD_KEY = "sonar/head"
"""Set by the head in its rendezvous store: a headless node that can no longer read it has lost
the head."""
LAYOUT_KEY = "sonar/layout"
"""Set by the head: its `NodePlan.layout`, which every headless node must share."""
DP_LAYOUT_KEY = "sonar/dp/layout"
"""Set by the head of replicas over several machines: its `data_parallel_layout`."""
NODE_WAIT = 600.0
"""Seconds a node waits for the others to arrive when ``--distributed-timeout-seconds`` is unset."""


def node_key(node: int) -> str:
    """The rendezvous store's key under which headless node `node` leaves its address."""
    return f"sonar/node/{node}"


def replica_key(index: int) -> str:
    """The rendezvous store's key under which the headless node of replica `index` leaves
    ``"<address> <start> <count>"`` (its address, first replica and replica count)."""
    return f"sonar/dp/replica/{index}"


@dataclass(frozen=True)
class NodePlan:
    """The ranks of each node, and the address of each rank's actor host."""

    nnodes: int = 1
    node_rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29501

    @classmethod
    def of(cls, config: "EngineConfig") -> "NodePlan":
        return cls(config.nnodes, config.node_rank, config.world_size, config.master_addr, config.master_port)

    @property
    def per_node(self) -> int:
        return self.world_size // self.nnodes

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def local_rank(self, rank: int) -> int:
        """`rank`'s index among its node's ranks (its share of the node's cores, its GPU)."""
        return rank % self.per_node

    def ranks_of(self, node: int) -> range:
        return range(node * self.per_node, (node + 1) * self.per_node)

    def host_address(self, rank: int, host: str) -> str:
        """Where the actor host of `rank` (on a headless node reachable at `host`) listens."""
        return f"tcp://{host}:{self.master_port + rank}"

    @property
    def layout(self) -> str:
        """What every node must agree on: the world's ranks and the nodes they are split over."""
        return f"{self.world_size} ranks over {self.nnodes} nodes"

    def wait_seconds(self, timeout: float | None) -> float:
        return NODE_WAIT if timeout is None else timeout


def host_ended_key(index: int) -> str:
    """The rendezvous store's key under which the headless node of replica `index` lists the pids
    of the last actor hosts of that replica that ended (space-separated, newest last): the head
    fails a worker whose host is among them at once instead of after its ping deadline."""
    return f"sonar/dp/replica/{index}/ended"


ENDED_KEPT = 8
"""Pids of ended hosts a headless node keeps listed per rank's host (`host_ended_key`)."""


def node_beat_key(index: int) -> str:
    """The rendezvous store's counter that the headless node of replica `index` adds one to each
    time it checks on the head (every second): a counter that stops tells the head the node is gone."""
    return f"sonar/dp/replica/{index}/beats"


NODE_SILENT = 5.0
"""Seconds without a beat (`node_beat_key`) after which the head takes a replica's node for lost
and fails its worker, instead of waiting for the worker's ping deadline."""


def check_nodes(config: "EngineConfig") -> None:
    """Refuse a node layout Sonar cannot run, naming the flags (ValueError)."""
    n, rank, world = config.nnodes, config.node_rank, config.world_size
    if n < 1:
        raise ValueError(f"--nnodes must be at least 1, got {n}")
    if not 0 <= rank < n:
        raise ValueError(f"--node-rank must be in 0..{n - 1} (--nnodes {n}), got {rank}")
    if n == 1:
        return
    if world == 1:
        raise ValueError(
            f"--nnodes {n} splits the ranks of a tensor/pipeline-parallel group over the nodes, but there is "
            "one rank (--tensor-parallel-size x --pipeline-parallel-size = 1); replicas over several nodes are "
            "--data-parallel-size with --data-parallel-size-local and `sonar serve --headless` nodes"
        )
    if world % n:
        raise ValueError(
            f"--nnodes {n} must divide the ranks evenly: --tensor-parallel-size x --pipeline-parallel-size = "
            f"{config.tensor_parallel_size} x {config.pipeline_parallel_size} = {world}"
        )
    if config.pipeline_parallel_size > 1:
        raise ValueError(
            f"--pipeline-parallel-size {config.pipeline_parallel_size} over --nnodes {n} is not supported yet "
            "(the last stage answers rank 0 over a socket of the head's machine); split over nodes with "
            "--tensor-parallel-size only"
        )
    if config.data_parallel_size > 1:
        raise ValueError(
            f"--data-parallel-size {config.data_parallel_size} with --nnodes {n} is not supported: --nnodes splits "
            "one replica's ranks over nodes; replicas over several nodes (each with its ranks on its own node) are "
            "--data-parallel-size-local with `sonar serve --headless` nodes"
        )
    if config.distributed_executor_backend not in (None, "mp"):
        raise ValueError(
            f"--nnodes {n} starts the ranks of each node itself ('mp'), not with "
            f"--distributed-executor-backend {config.distributed_executor_backend}"
        )
    if not (0 < config.master_port and config.master_port + world <= 65535):
        raise ValueError(
            f"--master-port {config.master_port}: the ranks' actor hosts listen on --master-port + rank, "
            f"up to {config.master_port + world - 1}, which must be a port"
        )
    if len(config.node_hosts) not in (0, n - 1):
        raise ValueError(f"node_hosts: {len(config.node_hosts)} addresses for {n - 1} headless node(s)")


def rank_placement(config: "EngineConfig", rank: int, local: "Placement", start_timeout: float) -> "Placement":
    """Where rank `rank` runs: `local` (a process of this machine) on the head, else the actor
    host its headless node keeps for it; with data-parallel replicas over several machines, the
    actor host that the node of this replica (`EngineConfig.data_parallel_index`) keeps for the
    rank, all of a replica's ranks on its node. The one place ranks are put on nodes (another
    launcher of ranks replaces this seam)."""
    if replicas_spread(config):
        address = replica_site(config, config.data_parallel_index, rank)[0]
        return local if address is None else Remote(address, start_timeout=start_timeout)
    plan = NodePlan.of(config)
    node = plan.node_of(rank)
    if node == 0:
        return local
    if len(config.node_hosts) != config.nnodes - 1:
        raise ValueError(
            f"rank {rank} runs on node {node}, whose address is unknown: several nodes are started by "
            "`sonar serve --nnodes N` (the head gathers the nodes' addresses), not by the library"
        )
    return Remote(plan.host_address(rank, config.node_hosts[node - 1]), start_timeout=start_timeout)


def local_replicas(config: "EngineConfig") -> range:
    """The data-parallel replicas this machine runs (all of them unless ``--data-parallel-size-local``
    says fewer)."""
    count = config.data_parallel_size if config.data_parallel_size_local is None else config.data_parallel_size_local
    return range(config.data_parallel_start_rank, config.data_parallel_start_rank + count)


def replicas_spread(config: "EngineConfig") -> bool:
    """The replicas run on several machines: this one runs fewer than all of them."""
    return len(local_replicas(config)) < config.data_parallel_size


def data_parallel_layout(config: "EngineConfig") -> str:
    """What the head and its headless nodes must agree on: the replicas, and the ranks of each."""
    return (
        f"{config.data_parallel_size} data-parallel replicas of tp {config.tensor_parallel_size} x "
        f"pp {config.pipeline_parallel_size} rank(s)"
    )


def replica_host_address(host: str, rpc_port: int, index: int, world: int = 1, rank: int = 0) -> str:
    """Where the actor host of rank `rank` of replica `index` (of `world` ranks each, on a headless
    node reachable at `host`) listens."""
    return f"tcp://{host}:{rpc_port + index * world + rank}"


def replica_site(config: "EngineConfig", index: int, rank: int = 0) -> tuple[str | None, int, int]:
    """Where replica `index` runs, as the head sees it: the address of the actor host of its worker
    (of its rank `rank`, with several) (None: a process of this machine), and its index among, and
    the count of, the replicas of its machine (its share of that machine's cores and memory)."""
    here = local_replicas(config)
    if index in here:
        return None, index - here.start, len(here)
    for host, start, count in config.data_parallel_nodes:
        if start <= index < start + count:
            assert config.data_parallel_rpc_port is not None, "checked with the layout"
            address = replica_host_address(host, config.data_parallel_rpc_port, index, config.world_size, rank)
            return address, index - start, count
    raise ValueError(
        f"replica {index} runs on a headless node whose address is unknown: replicas over several nodes are "
        "started by `sonar serve` (the head gathers the nodes' addresses), not by the library"
    )


def check_data_parallel_nodes(config: "EngineConfig") -> None:
    """Refuse a layout of data-parallel replicas over machines that Sonar cannot run, naming the
    flags (ValueError)."""
    size, start, local = config.data_parallel_size, config.data_parallel_start_rank, config.data_parallel_size_local
    if local is not None and not 1 <= local <= size:
        raise ValueError(f"--data-parallel-size-local must be in 1..{size} (--data-parallel-size {size}), got {local}")
    count = size if local is None else local
    if start < 0 or start + count > size:
        raise ValueError(
            f"--data-parallel-start-rank {start} + --data-parallel-size-local {count} must be at most "
            f"--data-parallel-size {size} (this machine runs replicas start .. start + local - 1)"
        )
    if not replicas_spread(config):
        for flag, value in (
            ("--data-parallel-address", config.data_parallel_address),
            ("--data-parallel-rpc-port", config.data_parallel_rpc_port),
        ):
            if value is not None:
                raise ValueError(
                    f"{flag} takes effect only with replicas on several machines (--data-parallel-size-local "
                    f"below --data-parallel-size {size}), got {value}"
                )
        return
    for flag, value in (
        ("--data-parallel-address", config.data_parallel_address),
        ("--data-parallel-rpc-port", config.data_parallel_rpc_port),
    ):
        if value is None:
            raise ValueError(
                f"{flag} is needed: --data-parallel-size-local {count} of --data-parallel-size {size} puts "
                "replicas on other machines, which meet at the head's --data-parallel-address and "
                "--data-parallel-rpc-port"
            )
    port, world = config.data_parallel_rpc_port, config.world_size
    assert port is not None
    last = port + size * world - 1
    if not (0 < port and last <= 65535):
        raise ValueError(
            f"--data-parallel-rpc-port {port}: rank r of a headless node's replica i listens on "
            "--data-parallel-rpc-port + i x (--tensor-parallel-size x --pipeline-parallel-size) + r, "
            f"up to {last}, which must be a port"
        )
    if config.distributed_executor_backend == "ray":
        raise ValueError(
            "data-parallel replicas over several machines are started by `sonar serve --headless` on each, not by "
            "--distributed-executor-backend ray"
        )


def replica_on_node(config: "EngineConfig") -> bool:
    """Replica `config.data_parallel_index` runs on a headless node (its worker, or each of its
    ranks, in an actor host there). False where that node is not known yet (on the node itself)."""
    index = config.data_parallel_index
    if not replicas_spread(config) or index in local_replicas(config):
        return False
    return any(start <= index < start + count for _, start, count in config.data_parallel_nodes)


def replicas_here(config: "EngineConfig") -> int:
    """How many replicas share the machine replica `config.data_parallel_index` runs on."""
    return replica_site(config, config.data_parallel_index)[2]
