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
NODE_WAIT = 600.0
"""Seconds a node waits for the others to arrive when ``--distributed-timeout-seconds`` is unset."""


def node_key(node: int) -> str:
    """The rendezvous store's key under which headless node `node` leaves its address."""
    return f"sonar/node/{node}"


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
            "one rank (--tensor-parallel-size x --pipeline-parallel-size = 1); data parallelism over several "
            "nodes is not supported yet"
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
        raise ValueError(f"--data-parallel-size {config.data_parallel_size} with --nnodes {n} is not supported yet")
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
    host its headless node keeps for it. The one place ranks are put on nodes (another launcher
    of ranks replaces this seam)."""
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
