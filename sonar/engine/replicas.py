"""Data parallelism: N engine replicas under one supervisor, and how the frontend reaches them.

With ``data_parallel_size`` N > 1 the engine tree (`data_parallel_spec`) is a supervisor
``engine`` over ``replica0`` .. ``replica{N-1}``, each a whole engine (`sonar.engine.tree.engine_spec`:
its own worker, detokenizer, scheduler and KV cache), strategy one_for_one: a replica whose own
supervisor gives up is restarted alone while the others keep serving; only repeated give-ups
(`REPLICA_RESTARTS`) end the engine. With N = 1 the tree is the single engine itself.

Each replica runs `replica_config`: its index, its worker in its own process unless ``--placement``
says otherwise (so the replicas compute in parallel, each on its share of the CPU cores, and one
crashing takes only its process down), and its share of the memory budget (``--kv-cache-memory-bytes``
is divided between the replicas; the CPU default KV size is divided by the worker,
`sonar.engine.runner.plan_kv_cache`), so N replicas use no more memory than one. On CUDA the
worker takes its replica's GPUs (`on_replica_gpus`): replica i of a machine's N runs its ranks on
GPUs ``first + i x ranks`` onwards where the machine has GPUs for every replica's ranks (each
replica the whole ``--gpu-memory-utilization`` of its own), else every replica on the same GPUs
with 1/N of it. Replicas placed by Ray (``--data-parallel-backend ray``) keep the whole
``--gpu-memory-utilization`` of the GPU their bundle holds; the other budgets are divided as for
replicas of one machine (Ray tells where a replica runs only when it starts).
With replicas over several machines (`sonar.engine.nodes`), a replica of a headless node has its
worker in the actor host that node keeps for it, and the budgets are shared by the replicas of
each machine.

The frontend (`sonar.engine.llm.LLM`) picks a replica per request with the router core
(`sonar.core.routing`) and reaches it through `Replicas`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import msgspec

from sonar.actors import SupervisorSpec
from sonar.actors.spec import OWN_GPU_ENV
from sonar.engine import cores
from sonar.engine.config import EngineConfig
from sonar.engine.nodes import replica_site
from sonar.engine.settings import parse_device_ids
from sonar.engine.tree import engine_spec

if TYPE_CHECKING:
    from sonar.actors import Supervisor

REPLICA_RESTARTS = 2
"""Give-ups of one replica, per replica and `REPLICA_PERIOD`, that the engine tolerates."""
REPLICA_PERIOD = 600.0
WORKER_LOST_AFTER = 10.0
"""Seconds the worker of a replica on another machine may stay down (crashed, hung, its node lost)
before the frontend moves that replica's requests to the replicas that serve
(`sonar.engine.replay`); a worker back sooner recomputes them itself, as a worker of this machine
always does."""


def replica_name(index: int) -> str:
    return f"replica{index}"


def replica_config(config: EngineConfig, index: int) -> EngineConfig:
    """The configuration replica `index` of `config.data_parallel_size` runs (see the module docstring)."""
    host, _, size = replica_site(config, index)  # the budget is shared by the replicas of one machine
    placement = dict(config.placement)
    if host is None:
        placement.setdefault("worker", "process")
    else:
        placement["worker"] = host
    kv_bytes = config.kv_cache_memory_bytes
    return msgspec.structs.replace(
        config,
        data_parallel_index=index,
        placement=placement,
        kv_cache_memory_bytes=None if kv_bytes is None else max(1, kv_bytes // size),
    )


def replica_gpus(config: EngineConfig, device_count: int, own_gpu: bool) -> tuple[int, int]:
    """Where replica ``config.data_parallel_index``'s ranks compute on a machine with
    `device_count` CUDA devices: (the CUDA index of its rank 0, the number of replicas sharing
    each of its GPUs). Its ranks take the GPUs from that index on (`sonar.engine.ranks.rank_device`).
    `own_gpu`: Ray gave each rank a GPU of its own (``--data-parallel-backend ray``)."""
    first = parse_device_ids(config.device_ids) or 0
    if config.data_parallel_size == 1 or own_gpu:
        return first, 1
    _, index, count = replica_site(config, config.data_parallel_index)
    if first + count * config.world_size <= device_count:
        return first + index * config.world_size, 1
    return first, count


def on_replica_gpus(config: EngineConfig) -> EngineConfig:
    """In a replica's worker process on CUDA: `config` with the replica's first GPU as its device
    and its share of ``--gpu-memory-utilization`` (`replica_gpus`); unchanged elsewhere."""
    from sonar.engine.device import select_device

    if config.data_parallel_size == 1 or select_device(config.device_ids).type != "cuda":
        return config
    import torch

    first, sharing = replica_gpus(config, torch.cuda.device_count(), bool(os.environ.get(OWN_GPU_ENV)))
    return msgspec.structs.replace(
        config, device_ids=str(first), gpu_memory_utilization=config.gpu_memory_utilization / sharing
    )


def data_parallel_spec(config: EngineConfig) -> SupervisorSpec:
    """The engine's supervision tree: the single engine, or with data parallelism a supervisor
    over the replicas' engines (see the module docstring)."""
    size = config.data_parallel_size
    if size == 1:
        return engine_spec(config)
    replicas = []
    for index in range(size):
        spec = engine_spec(replica_config(config, index))
        spec.name = replica_name(index)
        replicas.append(spec)
    return SupervisorSpec(
        "engine",
        replicas,
        strategy="one_for_one",
        max_restarts=REPLICA_RESTARTS * size,
        period=REPLICA_PERIOD,
        start_together=True,  # independent engines: their workers load side by side
    )


class Replicas:
    """The replicas' engine supervisors, looked up live: a restarted replica is a new supervisor."""

    def __init__(self, top: "Supervisor", count: int) -> None:
        self.top = top
        """The engine tree's supervisor: the engine itself when `count` is 1."""
        self.count = count

    def engine(self, index: int) -> "Supervisor":
        """Replica `index`'s engine supervisor (the one that last started, even if it has stopped
        since: asking its actors then fails as for any stopped actor)."""
        if self.count == 1:
            return self.top
        sup = self.top.child(replica_name(index)).child
        assert sup is not None, "the tree is running"
        return sup

    def index_of(self, name: str) -> int | None:
        """The replica index of a child name of the top supervisor ("replica3" -> 3), else None."""
        if self.count == 1 or not name.startswith("replica"):
            return None
        tail = name[len("replica") :]
        return int(tail) if tail.isdigit() and int(tail) < self.count else None


def pin_to_cpu_share(config: EngineConfig) -> list[int] | None:
    """In a replica's worker process: bind every thread of this process to the replica's share of
    the cores and size torch's intra-op pool to it (at most ``OMP_NUM_THREADS`` when set), so N
    replicas compute side by side instead of each spreading over every core. Returns the cores,
    or None where there is nothing to do (one replica, a CUDA device, no affinity control)."""
    if config.data_parallel_size == 1 or not hasattr(os, "sched_setaffinity"):
        return None
    from sonar.engine.device import select_device

    if select_device(config.device_ids).type != "cpu":
        return None
    _, index, count = replica_site(config, config.data_parallel_index)
    return cores.share_of_mine(index, count)
