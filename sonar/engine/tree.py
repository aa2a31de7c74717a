"""The engine's supervision tree: worker, KV offload manager, detokenizer, scheduler."""

from __future__ import annotations

from typing import Any

import msgspec

from sonar.actors import ActorRef, ChildProcess, ChildSpec, InProcess, Remote, SiblingRef, Supervisor, SupervisorSpec
from sonar.actors.spec import RayBundle
from sonar.engine import nodes
from sonar.engine.config import EngineConfig
from sonar.protocol.engine import DetokenizerMsg, SchedulerMsg, WorkerMsg
from sonar.protocol.offload import OffloadMsg

# The actors by path, with their protocols: building the tree imports none of them (torch among
# their imports), so a worker in its own process starts before this process has loaded them.
WORKER = "sonar.engine.worker:WorkerActor"
SCHEDULER = "sonar.engine.scheduler:SchedulerActor"
DETOKENIZER = "sonar.engine.detokenizer:DetokenizerActor"
OFFLOAD_MANAGER = "sonar.offload.manager:OffloadManagerActor"

WORKER_START_TIMEOUT = 900.0
"""Seconds a worker in its own process may take to become ready (load, compile, capture)."""


def worker_path(config: EngineConfig) -> str:
    """Where the worker the scheduler talks to sits below the engine's supervisor: ``worker``, or
    rank 0 of the tensor-parallel group ``worker`` (`SiblingRef` paths)."""
    return "worker/rank0" if _grouped(config) else "worker"


def _grouped(config: EngineConfig) -> bool:
    """The worker is a group of rank processes under this tree (under torchrun, this process is
    one rank and its one worker runs in it: the other ranks are torchrun's processes)."""
    return config.world_size > 1 and not config.launched


def worker_ref(engine: Supervisor) -> ActorRef[WorkerMsg]:
    """The running engine's worker that the scheduler talks to (rank 0 of a tensor-parallel group)."""
    runner: Any = engine.child("worker")
    if runner.kind == "supervisor":
        runner = runner.child.child("rank0")
    return runner.ref


def engine_spec(config: EngineConfig) -> SupervisorSpec:
    """The engine's supervision tree: worker (or its tensor-parallel group), the KV offload manager
    (only with offloading or KV events), detokenizer, scheduler (started in that order).

    one_for_one: a restarted worker is caught up by the scheduler (it recomputes the requests in
    flight); a restarted scheduler or detokenizer starts empty and the frontend fails the requests
    it had (see `open`).
    """
    raw = msgspec.to_builtins(config)
    worker_at = config.placement_of("worker")
    if config.launched:
        worker_at = InProcess()  # torchrun's rank is this process: its torch.distributed world is here
    elif nodes.replica_on_node(config):
        pass  # its ranks run in the actor hosts its headless node keeps for them (`nodes.rank_placement`)
    elif config.world_size > 1 or config.distributed_executor_backend == "ray":
        worker_at = ChildProcess()  # torch.distributed takes one process per rank (Ray places them)
    if isinstance(worker_at, (ChildProcess, Remote)):
        # the worker is ready once its model is loaded and, where asked, compiled and its CUDA
        # graphs captured: a cold compile alone takes minutes on a small CPU
        worker_at = msgspec.structs.replace(worker_at, start_timeout=max(worker_at.start_timeout, WORKER_START_TIMEOUT))
    worker = SiblingRef(worker_path(config))
    # The KV offload manager (second tiers, KV events) runs only when a flag asks for it. Restarted
    # alone, it starts with an empty CPU tier and re-indexes its disk directory; the scheduler's
    # mirror of the tiers resynchronizes, and requests meanwhile just miss the tiers.
    offload = []
    # Who talks to whom: the worker reports KV loads to the scheduler and moves chunks with the
    # offload manager; the detokenizer reports stop strings to the scheduler (later siblings,
    # named by the references they will have).
    worker_kwargs: dict[str, Any] = {
        "config": raw,
        # a headless node's replica has the actor host its node keeps for it to itself
        "own_process": isinstance(worker_at, ChildProcess) or nodes.replica_on_node(config),
        "scheduler": SiblingRef("scheduler"),
    }
    scheduler_kwargs: dict[str, Any] = {
        "config": raw,
        "worker": worker,
        "detokenizer": SiblingRef("detokenizer"),
    }
    if config.offload_manager_needed:
        tiers = config.offload_config()
        events = config.kv_events()
        offload.append(
            ChildSpec(
                "offload",
                OFFLOAD_MANAGER,
                protocol=OffloadMsg,
                kwargs={
                    "config": None if tiers is None else msgspec.to_builtins(tiers),
                    "events": None if events is None else msgspec.to_builtins(events),
                    "worker": worker,
                    "hash_algo": config.prefix_caching_hash_algo,
                },
                placement=config.placement_of("offload"),
                ping_interval=2.0,
                ping_timeout=30.0,
                shutdown=15.0,
            )
        )
        scheduler_kwargs["offload"] = worker_kwargs["offload"] = SiblingRef("offload")
    return SupervisorSpec(
        "engine",
        [
            _worker_spec(config, worker_kwargs, worker_at),
            *offload,
            ChildSpec(
                "detokenizer",
                DETOKENIZER,
                protocol=DetokenizerMsg,
                kwargs={
                    "worker": worker,
                    "tokenizer": config.tokenizer,
                    "scheduler": SiblingRef("scheduler"),
                },
                placement=config.placement_of("detokenizer"),
                ping_interval=2.0,
                ping_timeout=30.0,
            ),
            ChildSpec(
                "scheduler",
                SCHEDULER,
                protocol=SchedulerMsg,
                kwargs=scheduler_kwargs,
                placement=config.placement_of("scheduler"),
                ping_interval=2.0,
                ping_timeout=30.0,
            ),
        ],
        strategy="one_for_one",
        max_restarts=5,
        period=60,
    )


def _worker_spec(config: EngineConfig, kwargs: dict[str, Any], placement: Any) -> ChildSpec | SupervisorSpec:
    """The worker; with tensor or pipeline parallelism, a one-for-all group of one worker per rank,
    started together (rank 0, the one the others follow, opens the group's rendezvous and calls
    them in).

    The worker answers pings while a step runs (steps run off its mailbox loop), so the ping
    deadline only has to cover a busy machine; a hung step is the worker's own watchdog's job.
    """
    size = config.world_size if _grouped(config) else 1

    def rank(name: str, kwargs: dict[str, Any], placement: Any = placement) -> ChildSpec:
        return ChildSpec(
            name,
            WORKER,
            protocol=WorkerMsg,
            kwargs=kwargs,
            placement=_rank_placement(config, placement, kwargs.get("rank", 0)),
            ping_interval=2.0,
            ping_timeout=15.0,
            shutdown=5.0,
        )

    if size == 1:
        return rank("worker", kwargs)
    # rank 0 names its engine siblings from inside the group
    leader = {k: SiblingRef(f"../{v.name}") if isinstance(v, SiblingRef) else v for k, v in kwargs.items()}
    leader["followers"] = [SiblingRef(f"rank{r}") for r in range(1, size)]
    followers = [
        rank(
            f"rank{r}",
            {"config": kwargs["config"], "own_process": True, "rank": r, "leader": SiblingRef("rank0")},
            # a rank of another node (or of a headless node's replica) runs in the actor host that
            # node keeps for it
            nodes.rank_placement(config, r, placement, WORKER_START_TIMEOUT),
        )
        for r in range(1, size)
    ]
    # A rank lost is the group lost (its peers' collectives fail or hang): restart all of them.
    # All at once: rank 0's `JoinGroup` waits in the queue of a rank whose process still starts.
    return SupervisorSpec(
        "worker",
        [*followers, rank("rank0", leader)],
        strategy="one_for_all",
        max_restarts=5,
        period=60,
        start_together=True,
    )


def _rank_placement(config: EngineConfig, placement: Any, rank: int) -> Any:
    """Where rank `rank` runs: a process of this machine, or with the ``ray`` backend one kept by
    a Ray actor in bundle `rank` of the group's placement group (`sonar.actors.ray_runner`)."""
    if config.distributed_executor_backend != "ray":
        return placement
    import sonar.actors.ray_runner  # noqa: F401  (the runner of `RayBundle`; ray is an optional extra)

    # a rank on another Ray node listens at --master-port + rank there, as a headless node's do (past
    # the ports of the data-parallel replicas before its own); pipeline stages stay on one node (the
    # last one answers rank 0 over a local socket)
    port = config.master_port + config.data_parallel_index * config.world_size + rank
    port = port if config.pipeline_parallel_size == 1 else None
    # a replica Ray places (--data-parallel-backend ray) may have rank 0 on another node too: it
    # reaches the scheduler over tcp there, as a headless node's replica does
    anywhere = config.data_parallel_backend == "ray" and port is not None
    return RayBundle(
        bundle=rank, bundles=config.world_size, start_timeout=placement.start_timeout, port=port, anywhere=anywhere
    )
