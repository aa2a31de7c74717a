"""The in-process library API: `async with sonar.open(...) as llm`.

`open()` starts the engine's supervision tree (`sonar.engine.tree.engine_spec`: worker,
detokenizer, scheduler; with data parallelism one such engine per replica,
`sonar.engine.replicas`) inside the caller's event loop; `connect()` adds a small client actor
(`sonar.engine.client_actor`) that receives the detokenizer's outputs and hands each request's
deltas to the task waiting for them, and yields the `LLM` handle (`sonar.engine.llm`).
Everything it started is stopped when the block ends.
"""

from __future__ import annotations

import functools
import secrets
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

import anyio
import anyio.to_thread
import msgspec

from sonar.actors import Supervisor, supervise
from sonar.actors.actor import launch
from sonar.actors.supervisor import Event
from sonar.engine import tokenizers
from sonar.engine.client_actor import ClientActor, DeltaStream
from sonar.engine.config import EngineConfig
from sonar.engine.llm import LLM
from sonar.engine.nodes import replica_site
from sonar.engine.replicas import WORKER_LOST_AFTER, Replicas, data_parallel_spec
from sonar.engine.tree import worker_ref
from sonar.errors import InvalidRequestError
from sonar.lora.registry import parse_lora_modules
from sonar.protocol.engine import DescribeWorker


@asynccontextmanager
async def open(model: str | None = None, **engine_args: Any) -> AsyncIterator[LLM]:
    """Start an engine for `model` (None: the embedded SmolLM2-135M-Instruct) in this event loop.

    `engine_args` are the server's flags with underscores (`max_model_len`, `max_num_seqs`,
    `block_size`, `kv_cache_memory_bytes`, `dtype`, `seed`, `placement`, ...).
    """
    config = EngineConfig.from_args(model, **engine_args)
    if config.launched:
        async with _launched(config) as launched:
            yield launched
        return
    tokenizers.prefetch_for(config)
    async with supervise(data_parallel_spec(config)) as sup:
        async with connect(sup, config) as llm:
            yield llm


@asynccontextmanager
async def _launched(config: EngineConfig) -> AsyncIterator[Any]:
    """This torchrun rank's `LaunchedLLM` (`sonar.engine.launcher`): rank 0 runs the engine, with
    its worker in this process; the other ranks hold only their model's shards."""
    from sonar.engine import launcher
    from sonar.engine.runner import ModelRunner

    if config.async_scheduling is None:  # the ranks take one step at a time
        config = msgspec.structs.replace(config, async_scheduling=False)
    world = await anyio.to_thread.run_sync(launcher.join, config)
    try:
        if world.rank == 0:
            tokenizers.prefetch_for(config)
            async with supervise(data_parallel_spec(config)) as sup:
                async with connect(sup, config) as llm:
                    yield launcher.LaunchedLLM(world, llm)
        else:
            world.runner = await anyio.to_thread.run_sync(ModelRunner, config, world.topology, world.device)
            yield launcher.LaunchedLLM(world, None)
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(launcher.leave, world)


@asynccontextmanager
async def connect(sup: Supervisor, config: EngineConfig, model_name: str | None = None) -> AsyncIterator[LLM]:
    """An `LLM` on the running engine tree `sup` (built from `data_parallel_spec(config)`): starts
    the client actor that receives outputs, loads the tokenizer and the ``lora_modules``.
    `model_name`: the name the base model is served as (the adapters' parent)."""
    streams: dict[str, DeltaStream] = {}
    async with anyio.create_task_group() as tg:
        client_name = f"client-{secrets.token_hex(4)}"
        inc = await launch(tg, ClientActor(streams), client_name, 4096)
        replicas = Replicas(sup, config.data_parallel_size)
        info = await worker_ref(replicas.engine(0)).ask(DescribeWorker(), timeout=60)
        tokenizer_path = config.tokenizer or info.tokenizer_path
        if tokenizer_path is None:
            raise InvalidRequestError("the model has no tokenizer; pass tokenizer=...")
        tokenizer = await anyio.to_thread.run_sync(tokenizers.load, tokenizer_path)
        llm = LLM(config, sup, inc.ref, streams, info, tokenizer)
        llm.model_name = model_name or llm.model_name
        if llm.lora_registry is not None:
            llm.lora_registry.reserved = frozenset([llm.model_name])
        for module in parse_lora_modules(config.lora_modules or []):
            await llm.load_lora(module.name, module.path, module.base_model_name)

        watched = _watch(llm, replicas, tg, config)
        try:
            yield llm
        finally:
            for engine, listener in watched:
                if listener in engine.listeners:
                    engine.listeners.remove(listener)
            llm._closed = True
            llm.fail_replica(None, "the engine is shutting down")
            tg.cancel_scope.cancel()


def _ran_elsewhere(replicas: Replicas, index: int) -> bool:
    """A rank of replica `index`'s worker ran on another machine (Ray placed it there,
    ``--data-parallel-backend ray``): its actor host listened over tcp, where a host of this
    machine listens on a private ipc socket."""
    runner: Any = replicas.engine(index).child("worker")
    runners = runner.child.runners if runner.kind == "supervisor" and runner.child is not None else [runner]
    return any(str(getattr(r, "address", "")).startswith("tcp://") for r in runners)


def _watch(
    llm: LLM, replicas: Replicas, tg: anyio.abc.TaskGroup, config: EngineConfig
) -> list[tuple[Supervisor, Callable[[Any], None]]]:
    """Listen to the engine tree's events: end the requests a crash lost, move those of a lost
    replica, keep the router's view of the replicas current. Returns the (supervisor, listener)
    pairs added.

    Only a replica on another machine (a headless node's, or one Ray placed on another node) has
    its requests moved while its worker is down: its node may be gone for good. A worker of this
    machine comes back and recomputes its requests itself, which keeps the ones that cannot move
    (sampling without a seed does not repeat elsewhere).

    A worker of several ranks (tensor/pipeline parallelism) is a one-for-all group restarted
    inside its own supervisor: a rank's crash counts as the worker's, and rank 0 started again (the
    group met and loaded) as the worker back."""
    watched: list[tuple[Supervisor, Callable[[Any], None]]] = []
    router = llm.router
    down: dict[int, object] = {}
    """Replicas whose worker is down, each with a token of that outage."""

    async def move_if_still_down(index: int, outage: object, detail: str) -> None:
        await anyio.sleep(WORKER_LOST_AFTER)
        if down.get(index) is outage:
            llm.move_replica(index, f"its worker was not back within {WORKER_LOST_AFTER:g} s ({detail})")

    def on_engine_event(index: int | None, event: Any) -> None:
        # The worker can be restarted under running requests (the scheduler recomputes
        # them); the scheduler and the detokenizer hold request state that a restart
        # loses, so the requests they held end with an error rather than hang. When the
        # tree gives up, everything in flight ends with an error and new requests fail;
        # when one replica's engine gives up, only its requests do (its parent restarts it).
        where = "the engine" if index is None else f"replica {index}"
        if event.kind == "crash" and event.child in ("scheduler", "detokenizer"):
            llm.fail_replica(index, f"the {event.child} of {where} crashed ({event.detail}); request lost")
        elif event.kind == "give_up" and index is None:
            llm.dead = f"the engine gave up after repeated crashes ({event.detail})"
            llm.fail_replica(None, llm.dead)
        elif event.kind == "give_up":  # its parent restarts it; meanwhile its requests move
            down.pop(index, None)
            llm.move_replica(index, f"{where} gave up after repeated crashes ({event.detail})")
        if router is not None and index is not None:
            if event.kind == "give_up":
                router.set_available(index, False)
            elif event.kind == "crash" and event.child == "worker":
                # new requests go to the other replicas until it is back (a replica on a lost
                # node may be gone for long); the restarted worker's cache starts empty. Its
                # requests wait for it a while, then move to the replicas that serve.
                router.set_restarting(index, True)
                if index not in down and (
                    replica_site(config, index)[0] is not None or _ran_elsewhere(replicas, index)
                ):
                    down[index] = outage = object()
                    tg.start_soon(move_if_still_down, index, outage, event.detail)
            elif event.kind == "start" and event.child == "worker":
                router.set_restarting(index, False)
                down.pop(index, None)

    def on_group_event(index: int | None, event: Any) -> None:
        if event.kind == "crash":
            on_engine_event(index, Event(event.time, "crash", "worker", f"{event.child} {event.detail}"))
        elif event.kind == "start" and event.child == "rank0":
            on_engine_event(index, Event(event.time, "start", "worker"))

    def watch_group(engine: Supervisor, index: int | None) -> None:
        runner: Any = engine.child("worker")
        if runner.kind == "supervisor" and runner.child is not None:
            listener = functools.partial(on_group_event, index)
            runner.child.listeners.append(listener)
            watched.append((runner.child, listener))

    def on_replica_event(engine: Supervisor, index: int | None, event: Any) -> None:
        on_engine_event(index, event)
        if event.kind == "start" and event.child == "worker":  # a group restarted whole: a new supervisor
            watch_group(engine, index)

    def watch(engine: Supervisor, index: int | None) -> None:
        listener = functools.partial(on_replica_event, engine, index)
        engine.listeners.append(listener)
        watched.append((engine, listener))
        watch_group(engine, index)

    if replicas.count == 1:
        watch(replicas.top, None)
        return watched

    def on_top_event(event: Any) -> None:
        index = replicas.index_of(event.child)
        if event.kind == "give_up":
            on_engine_event(None, event)
        elif index is None:
            return
        elif event.kind in ("crash", "exit"):  # the replica's engine stopped: its requests move
            if router is not None:
                router.set_available(index, False)
            down.pop(index, None)
            llm.move_replica(index, f"replica {index} stopped ({event.detail})")
        elif event.kind == "start":  # the replica restarted: a new supervisor
            watch(replicas.engine(index), index)
            if router is not None:
                router.set_available(index, True)
                router.set_restarting(index, False)

    replicas.top.listeners.append(on_top_event)
    watched.append((replicas.top, on_top_event))
    for index in range(replicas.count):
        watch(replicas.engine(index), index)
    return watched
