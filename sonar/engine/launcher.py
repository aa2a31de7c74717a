"""Ranks started by torchrun (``distributed_executor_backend="external_launcher"``).

Under ``torchrun --nproc-per-node N script.py`` every process runs the same script: each opens the
engine with ``sonar.open(..., distributed_executor_backend="external_launcher",
tensor_parallel_size=T, pipeline_parallel_size=P)`` (T x P = N) and calls `generate` with the same
prompts, as RL frameworks do with vLLM. Each process is one rank of the model: torchrun's
``env://`` rendezvous makes the world (gloo on the CPU, NCCL on GPUs; over several nodes when
torchrun spans them, the same way) and every rank loads its own shards. Each engine a process
opens meets under a key prefix of its own in torchrun's store, so a script may close one engine
and open another on the same ranks.

The ranks agree on the steps because one of them decides: rank 0 runs the whole engine (scheduler,
detokenizer, its worker in-process) with synchronous scheduling, and its worker broadcasts each
step to the other ranks before running it, through a gloo group of its own beside the model's
collectives. The other ranks run no scheduler: their `generate` runs the steps rank 0 sends until
rank 0 broadcasts the call's outputs (or its error), which every rank then returns (or raises).
With pipeline stages the sampler (tensor rank 0 of the last stage) is another rank: it sends each
step's result back to rank 0's worker on a third group, so the steps go one at a time through every
stage (the scheduler runs as with one stage), and a step's grammar bitmask travels with it.

Each call starts with an all-gather of a digest of every rank's prompts and parameters, on a second
group: ranks that disagree all fail with `RequestMismatchError` rather than run different work into
a hang. A rank that dies breaks its peers' collectives (gloo reports the closed connection); one
that hangs, or stops calling `generate`, runs them into ``distributed_timeout_seconds`` (the
groups' timeout). Either way the others fail with `RankLostError`. The world is never rebuilt:
torchrun owns the processes, and its agent ends or restarts them all.

Steps that schedule no tokens (finished requests for the workers to forget) can come after a call's
outputs; rank 0 keeps them and sends them at the start of the next call, or at the close, so the
other ranks listen only while a call runs (a step with tokens always comes inside a call: only
`generate` adds requests, and scheduling is synchronous).
"""

from __future__ import annotations

import datetime
import hashlib
import os
import pickle
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import msgspec
import torch
import torch.distributed as dist

from sonar.engine import ranks
from sonar.engine.config import EngineConfig
from sonar.engine.device import select_device
from sonar.engine.llm import LLM, Prompt, RequestOutput
from sonar.engine.runner import ModelRunner
from sonar.errors import SonarError
from sonar.log import get_logger
from sonar.protocol.engine import ExecuteStep, StepResult
from sonar.sampling_params import SamplingParams

log = get_logger("sonar.launcher")

ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun sets in each rank's environment, and the rendezvous reads."""
WATCH_INTERVAL = 0.05
"""Seconds between rank 0's looks at whether its world broke while a call runs."""


class LauncherError(SonarError, RuntimeError):
    """The torchrun world cannot start, or a call cannot run on it."""


class RequestMismatchError(LauncherError):
    """The ranks called `generate` with different prompts or parameters."""


class RankLostError(LauncherError):
    """A rank died or stopped answering: the world is broken for good (torchrun restarts it)."""


@dataclass(frozen=True)
class LaunchedRank:
    """This process's place in the world torchrun started, from its environment."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], world_size: int) -> LaunchedRank:
        """The rank torchrun's variables describe; refused unless the world is one process per
        rank of the model (`world_size`: tensor x pipeline parallel size)."""
        launch = f"start the script with torchrun --nproc-per-node {world_size}"
        missing = [name for name in ENV_VARS if not environ.get(name)]
        if missing:
            raise LauncherError(
                f"distributed_executor_backend 'external_launcher' runs under torchrun, which sets "
                f"{', '.join(ENV_VARS)}; missing here: {', '.join(missing)} ({launch})"
            )
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
        try:
            rank, size, local, _ = (int(environ[name]) for name in names)
            local_size = int(environ.get("LOCAL_WORLD_SIZE") or size)
        except ValueError:
            raise LauncherError(
                f"torchrun's {', '.join(names)} and LOCAL_WORLD_SIZE must be integers, got "
                + ", ".join(f"{name}={environ.get(name)!r}" for name in (*names, "LOCAL_WORLD_SIZE"))
            ) from None
        if size != world_size:
            raise LauncherError(
                f"WORLD_SIZE={size}, but the model's ranks (tensor_parallel_size x pipeline_parallel_size) "
                f"are {world_size}: each torchrun process is one rank ({launch})"
            )
        if not (0 <= rank < size and 0 <= local < local_size):
            raise LauncherError(
                f"RANK={rank} LOCAL_RANK={local} outside WORLD_SIZE={size} / LOCAL_WORLD_SIZE={local_size}"
            )
        return cls(rank, size, local, local_size)


def request_digest(call: int, prompts: Sequence[Prompt], params: SamplingParams, lora: str | None = None) -> bytes:
    """What must be the same on every rank for call number `call` (sha256 of its pickle)."""
    return hashlib.sha256(pickle.dumps((call, list(prompts), params, lora), protocol=5)).digest()


@dataclass
class _Outputs:
    """Rank 0's answer to call `call`: its outputs, or the exception it raised."""

    call: int
    outputs: list[RequestOutput] | None
    error: BaseException | None


@dataclass
class _Step:
    """A step rank 0 shares: with several stages, its grammar rows' bitmask for the sampler (the
    scheduler sends that to rank 0's worker alone, beside the step)."""

    msg: ExecuteStep
    bitmask: Any = None


class _Close:
    """Rank 0 closed its engine: no more steps."""


class World:
    """This process's rank in torchrun's world: the model's topology and the gloo groups beside it
    (`steps`: rank 0's broadcasts; `control`: each call's digests; `results`: the sampler's
    answers, with pipeline stages)."""

    def __init__(self, launched: LaunchedRank, config: EngineConfig, prefix: str = "") -> None:
        self.launched = launched
        self.rank = launched.rank
        device = select_device(config.device_ids)
        if device.type == "cuda":
            device = ranks.rank_device(device, launched.local_rank)
        else:  # each rank of this machine computes on its share of the cores
            ranks.pin_to_cores(launched.local_rank, launched.local_world_size)
        self.device = device
        timeout = config.collective_timeout(device.type)
        store = ranks.launched_store(launched.rank, launched.world_size, timeout, prefix)
        _agree(store, launched, config)
        self.topology = ranks.join_launched(
            store, launched.rank, config.tensor_parallel_size, config.pipeline_parallel_size, device, timeout
        )
        timeout = config.collective_timeout("cpu")
        kwargs = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
        self.steps = dist.new_group(backend="gloo", **kwargs)
        self.control = dist.new_group(backend="gloo", **kwargs)
        sampler = self.topology.sampler
        self.results = dist.new_group([0, sampler], backend="gloo", **kwargs) if sampler else None
        """With several stages: the sampler's answer to each step, to rank 0 (None: rank 0 samples)."""
        self.runner: ModelRunner | None = None
        """A rank other than 0: its model (rank 0's is its worker's)."""
        self.calls = 0
        self.broken: str | None = None
        """Why the world is broken (None: it is not)."""
        self._claimed = False
        self._active = False
        """Rank 0: a call runs, so the other ranks listen."""
        self._deferred: list[_Step] = []
        self._lock = threading.Lock()  # the worker's thread and the caller's share `steps`

    # -- rank 0's worker --------------------------------------------------------------------------
    def claim(self) -> None:
        """Rank 0's worker takes its place in the world, once: a worker that crashed cannot rejoin
        (torch.distributed holds one world per process, and its peers' collectives broke)."""
        if self.broken is not None:
            raise RankLostError(f"the torchrun world is broken ({self.broken}); torchrun must start it again")
        if self._claimed:
            self.lose("rank 0's worker crashed, and a torchrun rank cannot rejoin its world")
            raise RankLostError(f"the torchrun world is broken ({self.broken}); torchrun must start it again")
        self._claimed = True

    def share_step(self, msg: ExecuteStep, bitmask: Any = None) -> None:
        """Rank 0's worker, before it runs `msg`: the same step to every other rank (`bitmask`: its
        grammar rows' bitmask, when another rank samples)."""
        rows = msg.grammar_rows if bitmask is not None else []
        step = _Step(msgspec.structs.replace(msg, reply_to=None, fault=None, grammar_rows=rows), bitmask)
        with self._lock:
            if not self._active and not msg.output.num_scheduled_tokens:
                self._deferred.append(step)
                return
            self._send(step)

    def collect(self, msg: ExecuteStep, result: StepResult) -> StepResult:
        """Rank 0's worker, after its part of `msg`: the step's result. With several stages the
        sampler has it and sends it (or the exception its part raised) once the last stage ran;
        a step that computes nothing has no answer to wait for."""
        if self.results is None or not _computes(msg):
            return result
        answer = self._recv(src=self.topology.sampler, group=self.results)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def lose(self, reason: BaseException | str) -> None:
        """The world broke (a collective failed, a step raised): remember why, first reason wins."""
        if self.broken is None:
            self.broken = reason if isinstance(reason, str) else f"{type(reason).__name__}: {reason}"
            log.error("launcher.world_broken", rank=self.rank, reason=self.broken)

    # -- each call --------------------------------------------------------------------------------
    def begin(self, digest: bytes) -> int:
        """Every rank, as a call starts: compare the ranks' digests; rank 0 then sends the steps
        it kept. Returns the call's number."""
        self.calls += 1
        mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8)
        theirs = [torch.empty_like(mine) for _ in range(self.launched.world_size)]
        self._collective(dist.all_gather, theirs, mine, group=self.control)
        differ = [r for r, t in enumerate(theirs) if not torch.equal(t, theirs[0])]
        if differ:
            raise RequestMismatchError(
                f"generate call {self.calls}: the prompts or sampling parameters of rank(s) "
                f"{', '.join(map(str, differ))} differ from rank 0's; every torchrun rank must call "
                "generate with the same requests (the ranks run one engine)"
            )
        if self.rank == 0:
            with self._lock:
                self._active = True
                self._flush()
        return self.calls

    def finish(self, call: int, outputs: list[RequestOutput] | None, error: BaseException | None) -> None:
        """Rank 0, as call `call` ends: its outputs (or error) to every rank."""
        with self._lock:
            self._active = False
            self._send(_Outputs(call, outputs, _portable(error)))

    def follow(self, call: int) -> list[RequestOutput]:
        """A rank other than 0, during call `call`: run rank 0's steps until its outputs come."""
        while True:
            msg = self._recv()
            if isinstance(msg, _Step):
                self._run(msg)
            elif isinstance(msg, _Close):
                raise LauncherError(f"rank 0 closed its engine while rank {self.rank} waited in generate call {call}")
            elif msg.call != call:
                raise LauncherError(f"rank {self.rank} in generate call {call} got rank 0's outputs of call {msg.call}")
            elif msg.error is not None:
                raise msg.error
            else:
                return msg.outputs or []

    def close(self) -> None:
        """Every rank, as its engine closes: rank 0 sends the steps it kept and `_Close`; the others
        run them until `_Close`. Then the world is torn down."""
        try:
            if self.broken is None:
                if self.rank == 0:
                    with self._lock:
                        self._flush()
                        self._send(_Close())
                else:
                    while not isinstance(msg := self._recv(), _Close):
                        if isinstance(msg, _Step):
                            self._run(msg)
        except LauncherError as exc:  # a peer died before the close: nothing left to agree on
            log.warning("launcher.close_incomplete", rank=self.rank, error=str(exc))
        finally:
            dist.destroy_process_group()

    # -- the wire ---------------------------------------------------------------------------------
    def _run(self, step: _Step) -> None:
        """A rank other than 0: run rank 0's step; the sampler of several stages answers rank 0."""
        msg, bitmask = step.msg, step.bitmask
        answers = self.results is not None and self.topology.samples and _computes(msg)
        try:
            result = self.runner.execute(msg, None if bitmask is None else lambda: bitmask)
        except Exception as exc:
            if answers:  # rank 0 waits for this step's answer: the error, rather than its timeout
                try:
                    self._send(_portable(exc), src=self.rank, group=self.results)
                except LauncherError:
                    pass
            self.lose(exc)
            raise RankLostError(f"rank {self.rank} failed in step {msg.output.step_id}: {self.broken}") from exc
        if answers:
            self._send(result, src=self.rank, group=self.results)

    def _flush(self) -> None:
        deferred, self._deferred = self._deferred, []
        for step in deferred:
            self._send(step)

    def _send(self, obj: Any, src: int = 0, group: Any = None) -> None:
        """`obj`, pickled, from `src` to every rank of `group` (None: `steps`)."""
        group = self.steps if group is None else group
        data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=5)), dtype=torch.uint8)
        self._collective(dist.broadcast, torch.tensor([data.numel()], dtype=torch.int64), src=src, group=group)
        self._collective(dist.broadcast, data, src=src, group=group)

    def _recv(self, src: int = 0, group: Any = None) -> Any:
        """What `src` sends with `_send` on `group` (None: `steps`)."""
        group = self.steps if group is None else group
        size = torch.zeros(1, dtype=torch.int64)
        self._collective(dist.broadcast, size, src=src, group=group)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        self._collective(dist.broadcast, data, src=src, group=group)
        return pickle.loads(data.numpy().tobytes())

    def _collective(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        if self.broken is not None:
            raise RankLostError(f"the torchrun world is broken ({self.broken})")
        try:
            fn(*args, **kwargs)
        except Exception as exc:  # gloo: a peer closed its connection, or the timeout passed
            self.lose(exc)
            raise RankLostError(
                f"rank {self.rank}: a collective with the other ranks failed or timed out (a rank died, hangs, "
                f"or did not make the same call): {self.broken}"
            ) from exc


_world: World | None = None
"""The world this process joined (torch.distributed keeps one per process): rank 0's in-process
worker takes its place in it through `world`."""
_joins = 0
"""The worlds this process joined: every rank opens its engines in the same order, so the count
names the same world on each (its keys in torchrun's store)."""


def join(config: EngineConfig) -> World:
    """Join torchrun's world as the rank its environment names (blocking: the rendezvous waits for
    every rank, up to the collective timeout)."""
    global _world, _joins
    if _world is not None:
        raise LauncherError("this process already runs a torchrun rank's engine: one per process")
    launched = LaunchedRank.from_environ(os.environ, config.world_size)
    _joins += 1
    _world = World(launched, config, f"sonar/world{_joins}/")
    log.info("launcher.joined", rank=launched.rank, world_size=launched.world_size, device=str(_world.device))
    return _world


def leave(world: World) -> None:
    """`World.close`, and forget it."""
    global _world
    try:
        world.close()
    finally:
        _world = None


def world() -> World:
    """The world rank 0's worker runs in (`claim`ed)."""
    if _world is None:
        raise LauncherError("no torchrun world in this process: open the engine with sonar.open under torchrun")
    _world.claim()
    return _world


class LaunchedLLM:
    """One torchrun rank's handle on the engine the ranks run together: `generate` must be called
    with the same prompts and parameters on every rank, and returns the same outputs on each."""

    def __init__(self, world: World, engine: LLM | None) -> None:
        self.world = world
        self.engine = engine
        """Rank 0: the engine it runs (None on the other ranks)."""

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def world_size(self) -> int:
        return self.world.launched.world_size

    async def generate(
        self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None = None, *, lora: str | None = None
    ) -> list[RequestOutput]:
        """Generate for `prompts` (one prompt, or a list) on every rank; the outputs in prompt
        order, the same on every rank. `lora`: the LoRA adapter every prompt runs with, by its
        name in ``lora_modules`` (None: the base model)."""
        params = params or SamplingParams()
        batch = _as_batch(prompts)
        digest = request_digest(self.world.calls + 1, batch, params, lora)
        call = await anyio.to_thread.run_sync(self.world.begin, digest, abandon_on_cancel=True)
        if self.engine is None:
            return await anyio.to_thread.run_sync(self.world.follow, call, abandon_on_cancel=True)
        outputs, error = await self._lead(batch, params, lora)
        if self.world.broken is None or not isinstance(error, RankLostError):
            try:  # a broken world may still carry the error to ranks that live
                await anyio.to_thread.run_sync(self.world.finish, call, outputs, error, abandon_on_cancel=True)
            except RankLostError as exc:
                error = error or exc
        if error is not None:
            raise error
        return outputs or []

    async def _lead(
        self, batch: list[Prompt], params: SamplingParams, lora: str | None
    ) -> tuple[list[RequestOutput] | None, BaseException | None]:
        """Rank 0: run the call on its engine, watching for the world to break meanwhile."""
        result: list[list[RequestOutput]] = []
        error: list[BaseException] = []

        async def run() -> None:
            try:
                result.append(await self.engine.generate_many(batch, params, lora=lora))
            except Exception as exc:
                while isinstance(exc, ExceptionGroup):  # the batch's task group: its first request's error
                    exc = exc.exceptions[0]
                error.append(exc)
            tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            while self.world.broken is None:
                await anyio.sleep(WATCH_INTERVAL)
            tg.cancel_scope.cancel()
        if self.world.broken is not None:
            lost = RankLostError(f"generate failed: the torchrun world is broken ({self.world.broken})")
            if error:
                lost.__cause__ = error[0]
            return None, lost
        return (result[0], None) if result else (None, error[0])


def _agree(store: dist.Store, launched: LaunchedRank, config: EngineConfig) -> None:
    """Every rank opens the engine with the same configuration, or each fails naming the ranks
    that differ: before any collective, which another layout would hang in."""
    mine = hashlib.sha256(msgspec.json.encode(config)).hexdigest()
    store.set(f"config/{launched.rank}", mine)
    theirs = [store.get(f"config/{rank}").decode() for rank in range(launched.world_size)]
    differ = [rank for rank, digest in enumerate(theirs) if digest != theirs[0]]
    if differ:
        raise LauncherError(
            f"the engine arguments of rank(s) {', '.join(map(str, differ))} differ from rank 0's; every torchrun "
            "rank must open the engine with the same model and arguments (the ranks run one engine)"
        )


def _computes(msg: ExecuteStep) -> bool:
    """Whether `msg` runs a forward pass (else every rank only forgets requests, and the sampler
    has nothing to answer)."""
    return bool(msg.output.num_scheduled_tokens)


def _portable(error: BaseException | None) -> BaseException | None:
    """`error` as the other ranks can raise it: itself when it survives pickling, else a
    `LauncherError` with its class and message."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error, protocol=5))
    except Exception:
        return LauncherError(f"rank 0 raised {type(error).__name__}: {error}")
    return error


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text, token ids, a dict) as a batch of one; a list of prompts as it is."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(item, int) for item in items):
        return [items]
    return items
