"""The worker actor: a thin shell around the `ModelRunner` of one device (`sonar/engine/runner.py`).

Loading and forward passes run in a thread. A step is started from `handle` and answered later,
so the mailbox loop stays free while it computes: liveness pings are answered at once, and a
watchdog beside the loop (`run`) enforces the worker's own liveness deadline on the step (see
`deadline`). A step past the deadline counts as a hang: in its own process the worker exits (the
stuck thread goes with it) and its supervisor restarts it; in-process it crashes (the thread
cannot be stopped and is left behind, so the `process` placement is the one to use in earnest).
An exception in a step crashes the worker, as does an injected fault (`sonar.engine.faults`).
A multi-step decode (`SchedulerOutput.decode_steps`) is one step of several decode steps; a
`CutSteps` from the mailbox ends it after the one its thread is running.

KV offloading: a step's `kv_stores` are copied out of the cache first, before its forward pass
(their blocks may already belong to requests of this very step), and sent to the offload manager
(`Store`); each of its `kv_loads` becomes a task of its own (`Load` from the manager, copy into
the cache, `KVLoaded` to the scheduler) that runs beside the forward pass, off the step's
critical path. A failed store is dropped and a failed load reports 0 blocks (they are recomputed).

Tensor and pipeline parallelism (`sonar.models.parallel`, `sonar.engine.ranks`): each rank of a
group is a worker actor in its own process, under a one-for-all supervisor (`sonar.engine.tree`).
Rank 0 is the one the scheduler talks to: when it starts it opens the group's rendezvous and sends
each other rank a `JoinGroup`; every rank then joins the torch.distributed group and loads its
shards. Rank 0 forwards every step to the other ranks before it runs it itself (no reply wanted:
the collectives keep the ranks in step) and passes grammar bitmasks on to the sampler (tensor rank
0 of the last stage), which samples. With one stage that is rank 0 itself; with several, the
sampler sends rank 0 the result (`StepDone`), which rank 0 answers the scheduler with while its own
stage already runs the next step. Any
rank that fails takes the group down with it: its peers' collectives fail or hang, and the
supervisor restarts all. Over several nodes (`sonar.engine.nodes`) the ranks of the other nodes
run in actor hosts there, and each incarnation meets at the head's store under a prefix of its own.

Structured outputs: a step with `grammar_rows` waits, after its forward pass and before it
samples, for the `StepBitmask` of its step id (the scheduler sends it once the matchers have the
previous step's tokens); past `BITMASK_TIMEOUT` the step fails like any other crash.

Sleep mode (`Sleep`, `WakeUp`; `sonar.engine.sleep`): between steps, under the step lock, the
worker frees its KV cache and moves or drops its weights, and restores them; `DescribeWorker`
answers its sleep state. Profiling (`StartProfile`, `StopProfile`; `sonar.engine.profiler`):
torch's profiler records only the thread that started it, so a worker with ``--profiler-config``
runs its steps, and starts and stops the profiler, in one thread of its own. Weight updates
(`UpdateWeights`, ``--weight-transfer-config``; `sonar.engine.weights`): between steps, under the
step lock, checked whole before a parameter is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import secrets
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import anyio
import anyio.to_thread
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from sonar.actors import Actor, ActorError, ActorNotFound, ActorRef
from sonar.actors.actor import NO_REPLY
from sonar.actors.messages import RemoteError, ReplyTo
from sonar.actors.node import get_node
from sonar.actors.spec import RENDEZVOUS_HOST_ENV
from sonar.core.outputs import KVLoadSpec, KVStoreSpec
from sonar.core.weights import WeightUpdateError
from sonar.engine import launcher, nodes, ranks
from sonar.engine.config import EngineConfig
from sonar.engine.device import select_device
from sonar.engine.profiler import ProfilerConfig, TraceProfiler
from sonar.engine.replicas import on_replica_gpus, pin_to_cpu_share
from sonar.engine.runner import ModelRunner, UnknownRequestError
from sonar.engine.sleep import SleepingRunner, WorkerAsleepError
from sonar.engine.weights import WeightUpdater
from sonar.errors import NotEnabledError, SonarError
from sonar.log import get_logger
from sonar.offload.transfer import gather_chunks, scatter_chunks
from sonar.protocol.engine import (
    CutSteps,
    DescribeWorker,
    ExecuteStep,
    JoinGroup,
    KVLoaded,
    ProfileStatus,
    SchedulerMsg,
    Sleep,
    StartProfile,
    StepBitmask,
    StepDone,
    StepResult,
    StepTokens,
    StopProfile,
    UpdateWeights,
    WakeUp,
    WorkerMsg,
)
from sonar.protocol.offload import ChunkMeta, Load, OffloadMsg, Store

log = get_logger("sonar.worker")

EXIT_HUNG = 75
"""Exit code of a worker process that found its own step hung."""
EXIT_INJECTED = 137
"""Exit code of a worker process told to die by --fault-injection (what a SIGKILL reports)."""
BITMASK_TIMEOUT = 60.0
"""Seconds a step with grammar rows waits for its `StepBitmask` after its forward pass."""
KEPT_BITMASKS = 8
"""Bitmasks kept for steps not run yet (a step voided by a failure never collects its own)."""


class _BitmaskSlot:
    """Where a step's bitmask arrives (the mailbox loop) and is awaited (the step's thread)."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.bitmask: Any = None


class WorkerHung(SonarError, RuntimeError):
    pass


class InjectedFault(SonarError, RuntimeError):
    pass


class WorkerActor(Actor):
    protocol = WorkerMsg

    def __init__(
        self,
        config: dict[str, Any],
        own_process: bool = False,
        scheduler: ActorRef[SchedulerMsg] | None = None,
        offload: ActorRef[OffloadMsg] | None = None,
        rank: int = 0,
        followers: list[ActorRef[WorkerMsg]] | None = None,
        leader: ActorRef[WorkerMsg] | None = None,
    ) -> None:
        self.config = msgspec.convert(config, EngineConfig)
        self.own_process = own_process
        self.rank = rank
        """This worker's tensor-parallel rank (0 without tensor parallelism)."""
        self.followers = followers or []
        """Rank 0 of a group: the other ranks, in rank order."""
        self.leader = leader
        """A rank other than 0: rank 0, which the sampler of several stages answers (`StepDone`)."""
        # under torchrun, rank 0's world brings the sampler's answer back within the step
        self.stages = 1 if self.config.launched else self.config.pipeline_parallel_size
        self._awaiting: dict[int, ReplyTo] = {}
        """Rank 0 of several stages: where to answer each step in flight once the sampler has."""
        self.runner: ModelRunner | None = None
        self.scheduler = scheduler
        """Where finished KV loads are reported (`KVLoaded`)."""
        self.offload = offload
        """The KV offload manager (None: no offloading): where `kv_stores` go, `kv_loads` come from."""
        self.slowest = 0.0
        self.worst_per_token = 0.0
        self.step_started: float | None = None
        self.step_tokens = 0
        self._bitmasks: dict[int, _BitmaskSlot] = {}
        self._unhang = threading.Event()
        """Releases an injected hang once the worker has given up on the step (in-process, the
        thread would otherwise outlive the actor and keep the interpreter from exiting)."""
        self.sleeper: SleepingRunner | None = None
        """Sleep mode (``enable_sleep_mode``): the runner and what of it sleeps."""
        self.profiler: TraceProfiler | None = None
        """``--profiler-config``: the profiler of this worker's steps."""
        self._step_thread: ThreadPoolExecutor | None = None
        """With a profiler: the one thread steps run in (else anyio's thread pool)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        """The loop of this actor (set at start), for the step thread to hand it tokens
        (`_emitter`),"""
        self._tokens_out: MemoryObjectSendStream[StepTokens] | None = None
        """and the stream they go into, for the step running, while it streams."""
        self.updater: WeightUpdater | None = None
        """``--weight-transfer-config``: what checks and applies weight updates."""
        self.world: launcher.World | None = None
        """Under torchrun (``external_launcher``): the world whose other ranks run each step too."""

    async def started(self) -> None:
        if self.own_process:  # a data-parallel replica's worker computes on its share of the cores
            pin_to_cpu_share(self.config)
        self.config = on_replica_gpus(self.config)  # or on its GPUs
        self.lock = anyio.Lock()
        self._loop = asyncio.get_running_loop()
        profiler = ProfilerConfig.parse(self.config.profiler_config)
        if profiler is not None:
            self._step_thread = ThreadPoolExecutor(1, thread_name_prefix="sonar-step")
            name = f"worker{self.config.data_parallel_index}-rank{self.rank}"
            self.profiler = TraceProfiler(profiler, name, select_device(self.config.device_ids).type)
        if self.config.launched:  # torchrun's rank: this process's world, joined by `sonar.open`
            self.world = launcher.world()
            self.runner = await anyio.to_thread.run_sync(
                ModelRunner, self.config, self.world.topology, self.world.device
            )
        elif self.config.world_size == 1:
            self.runner = await anyio.to_thread.run_sync(ModelRunner, self.config)
        elif self.rank == 0:
            self.runner = await self._lead_group()
        else:
            return  # its runner comes with rank 0's `JoinGroup`
        self.info = msgspec.structs.replace(
            self.runner.info,
            instance=secrets.token_hex(8),
            tensor_parallel_size=self.config.tensor_parallel_size,
            pipeline_parallel_size=self.config.pipeline_parallel_size,
        )
        if self.config.enable_sleep_mode:
            self.sleeper = SleepingRunner(self.config, self.runner)
        if self.config.weight_transfer() is not None:
            self.updater = WeightUpdater(self.runner)

    # -- parallel groups -------------------------------------------------------------------------
    async def _lead_group(self) -> ModelRunner:
        """Rank 0: open this incarnation's rendezvous, tell the other ranks, join and load with them.
        Over several nodes the rendezvous is the head's store, under a prefix of this incarnation."""
        cfg = self.config
        timeout = cfg.collective_timeout(select_device(cfg.device_ids).type)
        if cfg.nnodes > 1:
            host, port, prefix = cfg.master_addr, cfg.master_port, f"sonar/group/{secrets.token_hex(8)}/"
            store = await anyio.to_thread.run_sync(ranks.connect_store, host, port, prefix, timeout)
        else:  # on loopback, unless Ray spread the group over nodes (`RENDEZVOUS_HOST_ENV`)
            host, prefix = os.environ.get(RENDEZVOUS_HOST_ENV, ranks.LOOPBACK), ""
            store = await anyio.to_thread.run_sync(ranks.open_store, host, cfg.world_size, timeout)
            port = store.port
        join = JoinGroup(host, port, prefix)
        runner: list[ModelRunner] = []

        async def load() -> None:
            runner.append(
                await anyio.to_thread.run_sync(self._join_and_load, store, host, port, abandon_on_cancel=True)
            )

        try:
            async with anyio.create_task_group() as tg:
                for ref in self.followers:  # a rank that fails to join cancels the wait for the others
                    tg.start_soon(partial(ref.ask, join, timeout=self.config.step_timeout))
                tg.start_soon(load)
        except BaseExceptionGroup as group:
            raise group.exceptions[0] from None
        return runner[0]

    def _join_and_load(self, store: Any, host: str, port: int, prefix: str = "") -> ModelRunner:
        """Join the world as this worker's rank and load its shards of its stage (in a thread).
        Its device and cores are its node's: it is the local rank-th of the node's ranks."""
        cfg = self.config
        plan = nodes.NodePlan.of(cfg)
        device = select_device(cfg.device_ids)
        if device.type == "cuda":
            device = ranks.rank_device(device, plan.local_rank(self.rank))
        else:
            ranks.pin_to_cores(plan.local_rank(self.rank), plan.per_node)
        topology = ranks.join(
            store,
            host,
            port,
            self.rank,
            cfg.tensor_parallel_size,
            cfg.pipeline_parallel_size,
            device,
            cfg.collective_timeout(device.type),
            ranks.layer_counts_from_env(os.environ.get("SONAR_PP_LAYER_PARTITION")),
            prefix,
        )
        return ModelRunner(cfg, topology, device)

    @property
    def sampler(self) -> int:
        """The world rank that samples (`sonar.engine.ranks.Topology.sampler`)."""
        return (self.config.pipeline_parallel_size - 1) * self.config.tensor_parallel_size

    async def _join(self, msg: JoinGroup) -> None:
        """A rank other than 0: join, load, and answer rank 0."""
        node = get_node()
        try:
            self.runner = await anyio.to_thread.run_sync(
                self._join_and_load, None, msg.host, msg.port, msg.prefix, abandon_on_cancel=True
            )
        except Exception as exc:
            if msg.reply_to is not None:
                with anyio.CancelScope(shield=True):
                    await node.reply(msg.reply_to, error=RemoteError.from_exception(exc))
            raise
        if msg.reply_to is not None:
            await node.reply(msg.reply_to, None)

    async def handle(self, msg: WorkerMsg) -> Any:
        if isinstance(msg, ExecuteStep):
            if msg.grammar_rows and (self.sampler == self.rank or self.world is not None):
                self._bitmask_slot(msg.output.step_id)
            self.task_group.start_soon(self._step, msg)
            return NO_REPLY
        if isinstance(msg, StepBitmask):
            if self.followers and self.sampler != 0:  # the sampler, at the last stage, applies it
                await self.followers[self.sampler - 1].send(msg)
                return None
            slot = self._bitmask_slot(msg.step_id)
            slot.bitmask = msg.bitmask
            slot.ready.set()
            return None
        if isinstance(msg, CutSteps):  # read between the decode steps of the step thread
            if self.runner is not None:
                self.runner.cut(msg.step_id)
            return None
        if isinstance(msg, DescribeWorker):
            return self.info if self.sleeper is None else msgspec.structs.replace(self.info, sleep=self.sleeper.state)
        if isinstance(msg, (Sleep, WakeUp)):
            self.task_group.start_soon(self._sleep_or_wake, msg)
            return NO_REPLY
        if isinstance(msg, (StartProfile, StopProfile)):
            self.task_group.start_soon(self._profile, msg)
            return NO_REPLY
        if isinstance(msg, UpdateWeights):
            self.task_group.start_soon(self._update_weights, msg)
            return NO_REPLY
        if isinstance(msg, JoinGroup):
            self.task_group.start_soon(self._join, msg)
            return NO_REPLY
        if isinstance(msg, StepDone):
            reply_to = self._awaiting.pop(msg.step_id, None)
            if reply_to is not None:
                await get_node().reply(reply_to, msg.result, error=msg.error)
            return None
        raise TypeError(f"unexpected {type(msg).__name__}")

    def _bitmask_slot(self, step_id: int) -> _BitmaskSlot:
        slot = self._bitmasks.get(step_id)
        if slot is None:
            slot = self._bitmasks[step_id] = _BitmaskSlot()
            while len(self._bitmasks) > KEPT_BITMASKS:
                del self._bitmasks[next(iter(self._bitmasks))]
        return slot

    def _wait_bitmask(self, step_id: int, slot: _BitmaskSlot) -> Any:
        """The bitmask of step `step_id` (in the step's thread, after its forward pass)."""
        if not slot.ready.wait(BITMASK_TIMEOUT) and not self._unhang.is_set():
            raise WorkerHung(f"step {step_id} waited {BITMASK_TIMEOUT:g} s for its grammar bitmask")
        if slot.bitmask is None:
            raise InjectedFault(f"step {step_id} was abandoned while it waited for its grammar bitmask")
        return slot.bitmask

    async def stopping(self) -> None:
        self._release()
        if self._step_thread is not None:
            self._step_thread.shutdown(wait=False)

    async def _compute(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` in the step thread (abandoned on cancel: a crash must not wait for it)."""
        if self._step_thread is None:
            return await anyio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)
        return await asyncio.wrap_future(self._step_thread.submit(fn, *args))

    # -- sleep mode and profiling ----------------------------------------------------------------
    async def _sleep_or_wake(self, msg: Sleep | WakeUp) -> None:
        """Sleep or wake between steps and answer with the new state. A refused transition is
        answered as an error; a failure to free or restore memory also crashes the worker (its
        successor starts awake, whole)."""

        async def work() -> Any:
            if self.sleeper is None:
                raise NotEnabledError(
                    "sleep mode is off: start the engine with enable_sleep_mode (--enable-sleep-mode)"
                )
            async with self.lock:
                return await self._compute(self._apply_sleep if isinstance(msg, Sleep) else self._apply_wake, msg)

        await self._reply_with(msg, work, refused=(SonarError,))

    def _apply_sleep(self, msg: Sleep) -> Any:
        sleeper = self.sleeper
        self.runner = None  # the sleeper's reference must be the last one for level 2 to free the weights
        try:
            return sleeper.sleep(msg.level)
        finally:
            self.runner = sleeper.runner

    def _apply_wake(self, msg: WakeUp) -> Any:
        try:
            return self.sleeper.wake(msg.tags)
        finally:
            self.runner = self.sleeper.runner

    async def _update_weights(self, msg: UpdateWeights) -> None:
        """Apply a weight update between steps and answer what was written. A refused update
        wrote nothing and is answered as an error; any other failure (a checkpoint file that
        breaks while it is read) also crashes the worker, whose successor serves the startup
        checkpoint whole rather than a mix."""

        async def work() -> Any:
            if self.updater is None:
                raise NotEnabledError("weight updates are off: start the engine with --weight-transfer-config")
            async with self.lock:
                return await self._compute(self.updater.apply, self.runner, msg.path, msg.tensors)

        await self._reply_with(msg, work, refused=(WeightUpdateError, NotEnabledError))

    async def _profile(self, msg: StartProfile | StopProfile) -> None:
        """Start or stop the profiler between steps, here and on the other ranks of the group; a
        failure is answered, never a crash (the profiler holds nothing the steps need)."""

        async def work() -> ProfileStatus:
            if self.profiler is None:
                raise NotEnabledError("profiling is off: start the engine with a --profiler-config")
            async with self.lock:
                traces = await self._compute(
                    self.profiler.start if isinstance(msg, StartProfile) else self.profiler.stop
                )
            for ref in self.followers:
                status = await ref.ask(type(msg)(), timeout=self.config.step_timeout)
                traces = (traces or []) + status.traces
            return ProfileStatus(self.profiler.running, traces or [])

        await self._reply_with(msg, work, refused=(Exception,))

    async def _reply_with(
        self, msg: Any, work: Callable[[], Awaitable[Any]], refused: tuple[type[Exception], ...]
    ) -> None:
        """Run an ask's `work` and reply with its result. An exception of the `refused` kinds is
        replied as the error; any other is replied too, then crashes the worker (raised)."""
        node = get_node()
        try:
            result = await work()
        except refused as exc:
            if msg.reply_to is not None:
                await node.reply(msg.reply_to, error=RemoteError.from_exception(exc))
            return
        except Exception as exc:
            if msg.reply_to is not None:
                with anyio.CancelScope(shield=True):
                    await node.reply(msg.reply_to, error=RemoteError.from_exception(exc))
            raise
        if msg.reply_to is not None:
            await node.reply(msg.reply_to, result)

    def _release(self) -> None:
        """Let a step's thread go: an injected hang, a wait for a bitmask."""
        self._unhang.set()
        for slot in list(self._bitmasks.values()):
            slot.ready.set()

    def deadline(self) -> float:
        """Seconds the running step may take before it counts as hung: four times what the steps
        seen so far predict for it (the slowest step, or its token count at the slowest rate per
        token seen, whichever is more), plus `hang_margin`. A shared machine makes single steps
        several times slower than usual (seen: 9.6 s for a step predicted at 2.3 s), and a false
        hang costs a restart and a recompute, so the deadline is generous. Until a first step has
        finished, and while the runner compiles, `step_timeout`."""
        if self.slowest == 0.0:
            return self.config.step_timeout
        expected = max(self.slowest, self.step_tokens * self.worst_per_token)
        return min(4 * expected + self.config.hang_margin, self.config.step_timeout)

    async def run(self) -> None:
        """The watchdog: a step past its deadline means the worker is hung."""
        while True:
            await anyio.sleep(0.1)
            started = self.step_started
            if started is None:
                continue
            elapsed = time.monotonic() - started
            # a step that compiles takes as long as the compiler does
            limit = self.config.step_timeout if getattr(self.runner, "compiling", False) else self.deadline()
            if elapsed > limit:
                log.error(
                    "worker.hung", elapsed=round(elapsed, 2), deadline=round(limit, 2), slowest=round(self.slowest, 3)
                )
                if self.own_process:
                    os._exit(EXIT_HUNG)
                self._release()
                raise WorkerHung(f"a step has run {elapsed:.1f} s, past the liveness deadline of {limit:.1f} s")

    async def _step(self, msg: ExecuteStep) -> None:
        async with self.lock:  # steps run one at a time, in the order they came
            if msg.streamed and self.scheduler is not None:
                self._tokens_out, tokens = anyio.create_memory_object_stream[StepTokens](math.inf)
                self.task_group.start_soon(self._send_tokens, self.scheduler, tokens)
            if self.stages > 1 and self.rank == 0 and msg.reply_to is not None:
                self._awaiting[msg.output.step_id] = msg.reply_to
            # a multi-step decode is watched one decode step at a time (`_decode_step`)
            self.step_tokens = msg.output.num_scheduled_tokens // msg.output.decode_steps
            self.step_started = time.monotonic()
            try:
                if self.followers:  # the same step on every rank, in the same order
                    for rank, ref in enumerate(self.followers, start=1):
                        await ref.send(
                            msgspec.structs.replace(
                                msg,
                                reply_to=None,
                                streamed=[],
                                fault=msg.fault if msg.fault_rank == rank else None,
                                # the sampler waits for the grammar rows' bitmask, which rank 0 passes on
                                grammar_rows=msg.grammar_rows if rank == self.sampler else [],
                            )
                        )
                if msg.output.kv_stores or msg.output.kv_loads:
                    await self._kv_transfers(msg)
                # Abandoned on cancel: a crash (or a stop) must not wait for a step that may never
                # return; its result, if it ever comes, is dropped.
                result = await self._compute(self._execute, msg)
            except (UnknownRequestError, WorkerAsleepError) as exc:
                # A step sent to this worker's predecessor, or while it sleeps: answer with an error, stay up.
                await self._answer(msg, error=RemoteError.from_exception(exc))
                return
            except Exception as exc:
                with anyio.CancelScope(shield=True):
                    await self._answer(msg, error=RemoteError.from_exception(exc))
                raise
            finally:
                if self.step_started is not None:
                    self._timed(self.step_started, time.monotonic())
                self.step_started = None
                if self._tokens_out is not None:  # after the tokens the step handed over (FIFO)
                    self._tokens_out.close()
                    self._tokens_out = None
            if self.profiler is not None and self.profiler.running:  # past the watchdog: a trace may be written
                await self._compute(self.profiler.step)
        await self._answer(msg, result)

    async def _answer(
        self, msg: ExecuteStep, result: StepResult | None = None, error: RemoteError | None = None
    ) -> None:
        """Answer a step: to the scheduler, as a rule. With pipeline stages the sampler has the
        result: it sends it to rank 0 (`StepDone`), which answers then; rank 0 answers at once
        only when its own part failed."""
        step_id = msg.output.step_id
        if self.stages > 1 and self.rank == 0:
            if error is not None and self._awaiting.pop(step_id, None) is not None and msg.reply_to is not None:
                await get_node().reply(msg.reply_to, error=error)
            return
        if self.stages > 1 and self.rank == self.sampler:
            if self.leader is not None:
                try:
                    await self.leader.send(StepDone(step_id, result, error))
                except ActorNotFound:  # rank 0 is gone: the group restarts without this answer
                    log.warning("worker.step_done_lost", step=step_id)
            return
        if msg.reply_to is not None:
            await get_node().reply(msg.reply_to, result, error=error)

    # -- KV offloading -------------------------------------------------------------------------
    async def _kv_transfers(self, msg: ExecuteStep) -> None:
        """Copy out and send the step's stores, then start its loads (before the forward pass)."""
        out = msg.output
        offload = self.offload
        if out.kv_stores and offload is not None:
            try:
                data = await anyio.to_thread.run_sync(self._gather, out.kv_stores)
                metas = [ChunkMeta(s.block_hashes, s.parent_hash, s.token_ids, s.extra_keys) for s in out.kv_stores]
                await offload.send(Store(metas, data))
            except ActorNotFound:  # the manager is restarting or stopping: the chunks are not offloaded
                log.warning("worker.kv_store_dropped", chunks=len(out.kv_stores), reason="offload manager unavailable")
            except Exception as exc:  # the chunks are just not offloaded
                log.error("worker.kv_store_failed", chunks=len(out.kv_stores), error=f"{type(exc).__name__}: {exc}")
        for spec in out.kv_loads:
            self.task_group.start_soon(self._kv_load, spec)

    def _gather(self, stores: list[KVStoreSpec]) -> Any:
        block_ids = [b for spec in stores for b in spec.block_ids]
        return gather_chunks(self.runner.kv_caches, block_ids, len(stores[0].block_ids))

    async def _kv_load(self, spec: KVLoadSpec) -> None:
        """Load one request's prefix blocks and tell the scheduler how many arrived."""
        offload, notify = self.offload, self.scheduler
        loaded = 0
        try:
            if offload is not None:
                result = await offload.ask(
                    Load(spec.block_hashes, spec.start_block, count_hits=True), timeout=self.config.step_timeout
                )
                n = min(max(0, result.num_blocks - spec.start_block), len(spec.block_ids))
                if n and result.data is not None:
                    await anyio.to_thread.run_sync(
                        partial(
                            scatter_chunks,
                            self.runner.kv_caches,
                            result.data,
                            spec.block_ids[:n],
                            skip_blocks=result.skip_blocks,
                        )
                    )
                    loaded = n
        except Exception as exc:  # the blocks are recomputed
            log.warning("worker.kv_load_failed", request=spec.req_id, error=f"{type(exc).__name__}: {exc}")
            loaded = 0
        if notify is not None:
            try:
                await notify.send(KVLoaded(spec.req_id, loaded, spec.load_id))
            except Exception as exc:  # the scheduler is gone; its successor starts without this request
                log.warning("worker.kv_loaded_lost", request=spec.req_id, error=f"{type(exc).__name__}: {exc}")

    def _execute(self, msg: ExecuteStep) -> StepResult:
        if self.world is None:
            return self._run(msg)
        try:  # under torchrun, the other ranks run the step too; a failed step breaks the world
            self.world.share_step(msg, self._sampler_bitmask(msg))
            return self.world.collect(msg, self._run(msg))
        except Exception as exc:
            self.world.lose(exc)
            raise

    def _sampler_bitmask(self, msg: ExecuteStep) -> Any:
        """Under torchrun with several stages, the bitmask of `msg`'s grammar rows, which travels
        with the step to the sampler, another process (None: no grammar rows, or rank 0 samples)."""
        if not msg.grammar_rows or self.sampler == self.rank:
            return None
        step_id = msg.output.step_id
        try:
            return self._wait_bitmask(step_id, self._bitmasks.get(step_id) or _BitmaskSlot())
        finally:
            self._bitmasks.pop(step_id, None)

    def _run(self, msg: ExecuteStep) -> StepResult:
        if self.sleeper is not None and self.sleeper.state.is_sleeping:
            if not msg.output.requests:  # only finished requests to forget: the sleep forgot them all
                return StepResult(step_id=msg.output.step_id, sampled={})
            raise WorkerAsleepError(f"step {msg.output.step_id} reached the worker while it sleeps")
        if msg.fault is not None and msg.fault_rank == self.rank:
            self._inject(msg.fault, msg.output.step_id)
        if not msg.grammar_rows or self.rank != self.sampler:  # only the sampler applies bitmasks
            return self.runner.execute(msg, decode_step=self._decode_step, emit=self._emitter())
        step_id = msg.output.step_id
        slot = self._bitmasks.get(step_id) or _BitmaskSlot()  # gone: dropped as too old
        try:
            return self.runner.execute(msg, partial(self._wait_bitmask, step_id, slot))
        finally:
            self._bitmasks.pop(step_id, None)

    def _emitter(self) -> Callable[[StepTokens], None] | None:
        """Where a streaming multi-step decode's tokens go as they are sampled (`StepTokens`): from
        the step thread into the stream `_send_tokens` empties on this actor's loop, without
        waiting for it."""
        out, loop = self._tokens_out, self._loop
        if out is None or loop is None:  # the step does not stream (`_step` opened no stream)
            return None

        def hand_over(tokens: StepTokens) -> None:
            with contextlib.suppress(anyio.ClosedResourceError):  # a step abandoned, then done
                out.send_nowait(tokens)

        return lambda tokens: loop.call_soon_threadsafe(hand_over, tokens)

    async def _send_tokens(self, ref: ActorRef[SchedulerMsg], tokens: MemoryObjectReceiveStream[StepTokens]) -> None:
        async with tokens:
            async for msg in tokens:
                try:
                    await ref.send(msg)
                except (ActorError, ActorNotFound):  # the step's result carries them too
                    pass

    def _decode_step(self) -> None:
        """The next decode step of a multi-step decode starts (in the step thread): the one before
        counts as a step of its own, and the liveness deadline starts again, for one decode step."""
        now = time.monotonic()
        if self.step_started is not None:
            self._timed(self.step_started, now)
        self.step_started = now

    def _timed(self, started: float, ended: float) -> None:
        """A step of `step_tokens` ran from `started` to `ended`: what the deadline predicts from."""
        took = ended - started
        self.slowest = max(self.slowest, took)
        if self.step_tokens:
            self.worst_per_token = max(self.worst_per_token, took / self.step_tokens)

    def _inject(self, action: str, step_id: int) -> None:
        log.warning("worker.fault_injected", action=action, step=step_id)
        if action == "raise":
            raise InjectedFault(f"injected fault in the forward pass of step {step_id}")
        if action == "hang":
            self._unhang.wait()  # a real hang never returns; this one ends when the watchdog gives up
            raise InjectedFault(f"injected hang at step {step_id}, released after the worker gave up on it")
        if action == "exit":
            if self.own_process:
                os._exit(EXIT_INJECTED)
            raise InjectedFault(f"injected exit at step {step_id} (in-process: a crash)")
        raise ValueError(f"unknown fault action {action!r}")
