"""The scheduler actor: a thin shell around `sonar.core.Scheduler`.

Requests come in through the mailbox (`AddRequest`, `Abort`, `StopStringHit`); the step loop
runs beside it in `run()`: schedule, ask the worker to execute, feed the sampled tokens back into
the core, and pass what happened to the detokenizer. When a step fails (the worker crashed, hung
or was restarted), every running request is preempted and recomputed once the worker answers
again: clients see a pause, not an error. The requests of the failed step become suspects, which
the core runs one at a time; one that fails a step again on its own is quarantined: it ends with
``RequestQuarantinedError`` and the others go on (`sonar.core.quarantine`). A request the sampler
could draw no token for is failed alone too.

New requests are refused (``overloaded``) while `max_waiting_seqs` sequences wait.

Structured outputs: a request with `structured_outputs` gets its grammar matcher here, from the
process's compile cache (`sonar.structured.compiler_for`; the `LLM` handle compiled it already
when it runs in this process), and the core advances it with the tokens the request keeps. For a
step with grammar rows, `ExecuteStep.grammar_rows` names them and a `StepBitmask` follows: sent at
once in the synchronous loop, and with async scheduling as soon as the previous step's tokens are
fed back (the only tokens it could not know yet), so the bitmask is filled (in a thread) while the
step's forward pass runs, into one of two preallocated buffers (a buffer is reused two steps later,
when the worker is done with it).

Async scheduling (``async_scheduling``; by default on for a CUDA device, off on the CPU): step
N+1 is scheduled and sent while step N runs, before its tokens are back (the core counts them as
placeholders, the worker puts them in), so the worker starts the next step as soon as it
finishes one instead of waiting for the round trip through this actor; then step N's result is
fed back. At most one step is in flight besides the one running. A failed step takes the one
sent after it down too. Off with KV offloading and with a draft model or head; with ``ngram`` and
``suffix`` the worker makes the drafts (`SchedulerConfig.worker_drafts`).

Multi-step decode (``decode_steps``, 8 by default, ``--stream-interval`` above 1; synchronous loop
only): a step of plain decodes with nothing waiting may decode several tokens per request on the
worker (`sonar.core.schedule`). A request that arrives (or ends) while one is out sends the worker
`CutSteps`, so a newcomer waits for one decode step rather than all of them. The tokens of the
requests that stream come back as each decode step samples them (`StepTokens`, applied at once);
the result brings the rest.

Speculative decoding (``--speculative-config``): the core proposes drafts for decoding requests
(`sonar.core.speculative`) and the worker verifies them; its counters are in `GetStats`.

Iteration details (``--enable-logging-iteration-details``): each step that comes back logs a
`scheduler.iteration` line with its composition (`iteration_details`) and its elapsed time, from
sending it to its result (the worker's own share as `worker_ms`).

Pipeline stages (``--pipeline-parallel-size``): up to one step per stage in flight, each of
requests no other step in flight holds (`_run_stages`), so the stages overlap.

With the KV offload manager (`offload`): the core's lookups of the lower tiers read a mirror of
what they hold (`KVBlockIndex`), kept by a long poll of the manager's tier events (`WatchTiers`;
a restart of either side resynchronizes it from a snapshot); chunks the tiers drop are offered
again (`forget_offloaded`). Steps that only store or load KV still go to the worker, and the loop
waits only when no request is left and no transfer is pending. `KVLoaded` from the worker ends a
request's wait for its prefix. The block manager's GPU events go to the manager, which publishes
them with its own.

Sleep mode (`SleepEngine`, `WakeEngine`; `sonar.core.sleep`): going to sleep, the scheduler first
refuses new requests (``sleeping``, HTTP 503) and waits, up to the drain timeout, for the running
ones to finish (past it nothing changes and the sleep is refused); then it drops the prefix cache
(the KV it indexes is about to be freed) and puts the worker to sleep. It takes requests again
once the worker has woken every tag. A sleep or wake runs beside the mailbox, so aborts, stop
strings and the step loop go on while it waits.

Weight updates (`UpdateEngineWeights`, ``--weight-transfer-config``): the step loop stops before it
schedules its next step, the worker writes the new weights once the steps already sent are done
(its step lock), the prefix cache is dropped (its KV was computed with the old weights) and the
loop goes on. Requests are not drained: those running continue with the new weights, over the KV
they computed with the old ones (vLLM's ``keep``); their blocks stay out of the prefix cache, so
new requests never reuse KV of the old weights.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import anyio
import anyio.to_thread
import msgspec

from sonar.actors import Actor, ActorError, ActorNotFound, ActorRef, AskTimeout
from sonar.actors.actor import NO_REPLY
from sonar.actors.node import get_node
from sonar.actors.ref import PendingReply
from sonar.core import BlockManager, Request, RequestRejectedError, Scheduler, SchedulerConfig
from sonar.core.anyres import feature_rows, num_tiles
from sonar.core.events import AllBlocksCleared, BlockRemoved
from sonar.core.flops import MFUStats, ModelShape, step_cost
from sonar.core.kv_index import KVBlockIndex
from sonar.core.kv_residency import KVResidency
from sonar.core.outputs import RequestError, RequestModelTime, RequestUpdate, SchedulerOutput, StepRef
from sonar.core.schedule import media_runs
from sonar.core.sleep import SleepRefusedError, SleepState, plan_sleep
from sonar.core.thinking import ThinkingGate
from sonar.engine.config import DECODE_STEPS, EngineConfig
from sonar.engine.faults import FaultPlan
from sonar.engine.peak import peak_flops
from sonar.engine.step_spans import MAX_STEP_LINKS, StepMarks, StepTracer, iteration_details, step_tracer
from sonar.errors import InvalidRequestError, Rejection, RejectKind
from sonar.log import get_logger
from sonar.protocol.engine import (
    Abort,
    Accepted,
    AddRequest,
    CacheState,
    CountRequests,
    CutSteps,
    DescribeCache,
    DescribeWorker,
    DetokenizerMsg,
    ExecuteStep,
    Forget,
    GetSleepState,
    GetStats,
    ImageInput,
    KVLoaded,
    NewRequestData,
    SchedulerMsg,
    Sleep,
    SleepEngine,
    SleepReply,
    StepBitmask,
    StepOutputs,
    StepResult,
    StepTokens,
    StopStringHit,
    TrackRequest,
    UpdateEngineWeights,
    UpdateWeights,
    VisionInfo,
    WakeEngine,
    WakeUp,
    WeightUpdateReply,
    WorkerInfo,
    WorkerMsg,
)
from sonar.protocol.offload import OffloadMsg, PublishEvents, TierUpdate, WatchTiers
from sonar.structured import allocate_bitmask, compiler_for, fill_bitmasks, fill_draft_bitmasks

TIER_MEDIA = ("CPU", "DISK")

SAME_WORKER_GRACE = 5.0
"""Seconds a recovering scheduler waits for the worker that failed a step to be replaced (it
crashes right after it answers the failure) before it takes that worker's answers as its own."""

log = get_logger("sonar.scheduler")


class SchedulerActor(Actor):
    protocol = SchedulerMsg

    def __init__(
        self,
        config: dict[str, Any],
        worker: ActorRef[WorkerMsg],
        detokenizer: ActorRef[DetokenizerMsg],
        offload: ActorRef[OffloadMsg] | None = None,
    ) -> None:
        self.config = msgspec.convert(config, EngineConfig)
        self.worker = worker
        self.detokenizer = detokenizer
        self.offload = offload
        self.pending: list[TrackRequest] = []
        self.wake = anyio.Event()
        self.kicked = False
        """A message changed what the next `schedule()` can do (set by `handle`)."""
        self.steps = 0
        self.images_encoded = 0
        """Images the worker ran through its vision tower (`SchedulerStats.mm_encoder_runs`),"""
        self.images_reused = 0
        """and images it took from its encoder cache (`SchedulerStats.mm_encoder_cache_hits`)."""
        self.failure: Exception | None = None
        """Why the last failed step failed (logged by `_recover`)."""
        self.faults = FaultPlan.parse(self.config.fault_injection, seed=self.config.seed)
        offload_config = self.config.offload_config()
        self.offload_bpc = 0 if offload_config is None or offload is None else offload_config.blocks_per_chunk
        self.kv_events = offload is not None and self.config.kv_events() is not None
        self.tiers = KVBlockIndex()
        """Mirror of the block hashes each lower tier holds (what the core's lookups read)."""
        self.tier_epoch: str | None = None
        self.tier_seq = 0
        self.pipelined = False
        """Async scheduling: send the next step before the current one's result is back."""
        self.multi_step: tuple[int, int] | None = None
        """The multi-step decode out (`SchedulerOutput.decode_steps`): its step id and decode steps,
        until its result is back (only the synchronous loop sends one: it is the step awaited)."""
        self.stream_steps = False
        """A multi-step decode's tokens go out as each decode step samples them (`StepTokens`),
        not with its result (`EngineConfig.stream_steps`)."""
        self._streamed: dict[str, int] = {}
        """The tokens of the multi-step decode out that its `StepTokens` brought, per request;"""
        self._streamed_steps = 0
        """and how many of its decode steps they were."""
        self._outputs_lock = anyio.Lock()
        """Outputs reach the detokenizer in the order their tokens were applied: a step's result
        waits for the send of the `StepTokens` applied before it."""
        self.steps_overlapped = 0
        """Steps sent while an earlier one was still running (`SchedulerStats.steps_overlapped`)."""
        self.stages = 1
        """Pipeline stages of the worker: with more than one, `_run_stages` keeps that many steps
        in flight."""
        self._bitmasks: list[Any] = []
        """Two preallocated bitmask buffers (structured outputs), used in turn."""
        self._bitmask_turn = 0
        self._step_rows: dict[int, list[str]] = {}
        """The grammar rows of the steps sent whose bitmask is not sent yet."""
        self._iterations: dict[int, tuple[float, dict[str, int]]] = {}
        """--enable-logging-iteration-details: each step in flight's send time and composition."""
        self.sleep = SleepState()
        """Sleep mode: the worker's state as last reported."""
        self.draining = False
        """Going to sleep: new requests are refused while the running ones finish."""
        self.transition = False
        """A sleep or a wake-up is under way (one at a time)."""
        self.refreshing = False
        """The worker is being asked its sleep state (`_refresh_sleep`)."""
        self.shape: ModelShape | None = None
        """--enable-mfu-metrics: the model's shape, for each step's cost (`_costs`)."""
        self.mfu: MFUStats | None = None
        self._costs: dict[int, list[tuple[int, int, int]]] = {}
        """--enable-mfu-metrics: the estimated cost of each step in flight."""
        self._step_requests: dict[int, list[str]] = {}
        """--collect-detailed-traces: the requests of each step in flight,"""
        self._model_time: dict[str, list[float]] = {}
        """and each request's worker time so far: [execute, forward] seconds, steps."""
        self.tracer: StepTracer | None = None
        """--collect-detailed-traces with an OTLP endpoint: the per-step spans' exporter."""
        self._scheduled = (0, 0)
        """With `tracer`: when the last `schedule()` call started and ended (`time.monotonic_ns`)."""
        self._marks: dict[int, StepMarks] = {}
        """With `tracer`: each step in flight's scheduling times and work."""
        self._links: dict[str, list[StepRef]] = {}
        """With `tracer`: each request's step spans not yet sent on an update."""
        self._sent: set[PendingReply] = set()
        """Steps sent whose result the loop has not started waiting for."""
        self.updating: anyio.Event | None = None
        """A weight update is under way: the step loop waits for this event before its next step."""

    async def started(self) -> None:
        info: WorkerInfo = await self.worker.ask(DescribeWorker(), timeout=60)
        self.info = info
        self.sleep = info.sleep  # a scheduler restarted beside a sleeping worker sleeps too
        cfg = self.config
        wanted = cfg.async_scheduling if cfg.async_scheduling is not None else info.device != "cpu"
        # torchrun's ranks take one step at a time through every stage (`sonar.engine.launcher`)
        self.stages = 1 if cfg.launched else info.pipeline_parallel_size
        speculative = cfg.speculative()
        # left unset, async scheduling is off with a draft model or head; given, the worker fills
        # the draft slots with the drafts it made after the request's step before
        self.pipelined = (
            wanted
            and self.offload_bpc == 0
            and self.stages == 1
            and (speculative is None or not speculative.lookahead or cfg.async_scheduling is True)
        )
        blocks = BlockManager(
            info.num_blocks,
            info.block_size,
            enable_prefix_caching=cfg.enable_prefix_caching,
            hash_algo=cfg.prefix_caching_hash_algo,
            kv_events=self.kv_events,
            offload_blocks_per_chunk=self.offload_bpc,
        )
        if cfg.kv_cache_metrics:
            blocks.pool.residency = KVResidency(cfg.kv_cache_metrics_sample, seed=cfg.seed)
        if cfg.enable_mfu_metrics:
            self._start_mfu(info)
        if cfg.step_spans and cfg.otlp_traces_endpoint is not None:
            self.tracer = step_tracer(cfg.otlp_traces_endpoint)
        # an encoder's token attends to every other: its prompt is computed whole, in one step
        whole = info.pooling is not None and not info.pooling.causal
        decode_steps = cfg.decode_steps
        stages = info.pipeline_parallel_size  # torchrun's too: a stage that does not sample has no token to feed
        if decode_steps is None:  # the default on one rank where it can run, silently 1 elsewhere
            alone = info.tensor_parallel_size * stages == 1
            # a fault plan marks steps by their input tokens and counts them, and detailed traces
            # give each step a span and a request as many steps as tokens: one decode step each
            observed = self.faults is not None or cfg.collect_detailed_traces is not None
            plain = not self.pipelined and speculative is None and not observed
            decode_steps = DECODE_STEPS if alone and plain else 1
        elif decode_steps > 1 and (self.pipelined or stages > 1 or speculative is not None):
            why = "async scheduling" if self.pipelined else "pipeline stages" if stages > 1 else "speculation"
            log.warning(
                "scheduler.multi_step_off", decode_steps=decode_steps, reason=f"one decode step per step with {why}"
            )
            decode_steps = 1
        self.stream_steps = cfg.stream_steps and not (cfg.collect_detailed_traces or self.tracer is not None)
        self.core = Scheduler(
            SchedulerConfig(
                max_model_len=info.max_model_len,
                max_num_batched_tokens=max(cfg.max_num_batched_tokens, info.max_model_len if whole else 0),
                max_num_seqs=cfg.max_num_seqs,
                enable_chunked_prefill=cfg.enable_chunked_prefill and not whole,
                long_prefill_token_threshold=cfg.long_prefill_token_threshold,
                scheduling_policy=cfg.scheduling_policy,
                watermark=cfg.watermark,
                scheduler_reserve_full_isl=cfg.scheduler_reserve_full_isl,
                pipeline_stages=self.stages,
                speculative=speculative,
                worker_drafts=self.pipelined and speculative is not None,
                decode_steps=decode_steps,
                max_loras=cfg.max_loras if cfg.enable_lora else 0,
                whole_media=info.vision is not None and info.vision.bidirectional,
                longrope_switch=info.longrope_switch,
            ),
            blocks,
            lower_tier_lookup=self._lookup if self.offload_bpc else None,
        )
        if self.kv_events:
            # A new scheduler starts with an empty cache: whatever a predecessor announced is gone.
            await self._send_offload(PublishEvents([AllBlocksCleared("GPU")]))
        if self.offload_bpc:
            try:  # the mirror before the first request (else the watch below brings it soon)
                self._apply_tier_update(await self.offload.ask(WatchTiers(None, 0, 0.0), timeout=30))
            except (ActorError, AskTimeout, ActorNotFound) as exc:
                log.warning(
                    "scheduler.offload_unavailable", detail="the tiers are looked up once it answers", error=str(exc)
                )
            self.task_group.start_soon(self._watch_tiers)

    def _start_mfu(self, info: WorkerInfo) -> None:
        """--enable-mfu-metrics: the model's shape from the worker's description, and the
        device's peak; a model whose projections the worker does not describe (a pooling model)
        gets no estimate, and says so."""
        if "q_proj" not in info.projections:
            log.warning("mfu.unavailable", reason="the model's projections are unknown (not a decoder)")
            return
        dtype_bytes = DTYPE_BYTES.get(info.dtype, 2)
        self.shape = ModelShape.of(info.projections, info.num_hidden_layers, info.vocab_size, dtype_bytes)
        self.mfu = MFUStats(peak_flops=peak_flops(info.device, info.device_name, info.dtype))
        log.info("mfu.enabled", peak_flops=self.mfu.peak_flops, device=info.device_name or info.device)

    async def handle(self, msg: SchedulerMsg) -> Any:
        if isinstance(msg, AddRequest):
            return await self._add(msg)
        if isinstance(msg, Abort):
            found = self.core.abort(msg.request_ids)
            dropped = {t.req_id for t in self.pending} & set(msg.request_ids)
            self.pending = [t for t in self.pending if t.req_id not in dropped]
            if found:
                await self.detokenizer.send(Forget(found))
                await self._cut_steps()
            return None
        if isinstance(msg, StepTokens):
            await self._stream_tokens(msg)
            return None
        if isinstance(msg, StopStringHit):
            if self.core.finish_stopped(msg.hits):
                await self._cut_steps()
            return None
        if isinstance(msg, GetStats):
            stats = self.core.stats()
            stats.steps_overlapped = self.steps_overlapped
            stats.num_steps = self.steps
            stats.mm_encoder_runs, stats.mm_encoder_cache_hits = self.images_encoded, self.images_reused
            stats.mfu = self.mfu
            return stats
        if isinstance(msg, CountRequests):
            return len(self.core.requests) + len(self.pending)
        if isinstance(msg, DescribeCache):
            hashes = [b.block_hash for b in self.core.block_manager.pool.blocks if b.block_hash is not None]
            return CacheState(hashes, self.tier_epoch)
        if isinstance(msg, KVLoaded):
            if self.core.finish_kv_load(msg.req_id, msg.num_blocks, msg.load_id):
                self.kicked = True
                self.wake.set()
            return None
        if isinstance(msg, GetSleepState):
            if not self.sleep.is_sleeping or self.transition:
                return SleepReply(self.sleep)
            self.task_group.start_soon(self._refresh_sleep, msg)
            return NO_REPLY
        if isinstance(msg, (SleepEngine, WakeEngine)):
            if self.transition:
                return SleepReply(self.sleep, "another sleep or wake-up is under way; try again when it is done")
            self.transition = True
            self.task_group.start_soon(self._go_to_sleep if isinstance(msg, SleepEngine) else self._wake_up, msg)
            return NO_REPLY
        if isinstance(msg, UpdateEngineWeights):
            if self.updating is not None:
                return WeightUpdateReply(
                    refused="another weight update is under way; send this one when it is done", conflict=True
                )
            self.updating = anyio.Event()
            self.task_group.start_soon(self._update_weights, msg)
            return NO_REPLY
        raise TypeError(f"unexpected {type(msg).__name__}")

    async def _grammar(self, msg: AddRequest) -> Any:
        """The grammar matcher of a structured output request (None for free text)."""
        spec = msg.params.structured_outputs
        if spec is None:
            return None
        cfg, info = self.config, self.info
        path = cfg.tokenizer or info.tokenizer_path
        if path is None:
            raise InvalidRequestError("structured outputs need the model's tokenizer", param="structured_outputs")
        compiler = await anyio.to_thread.run_sync(compiler_for, path, info.vocab_size, info.eos_token_ids)
        structured = cfg.structured_config()
        compiled = await compiler.compile(
            spec,
            structured,
            max_chars=cfg.max_structured_output_chars,
            timeout=cfg.structured_outputs_compile_timeout,
        )
        fmt = structured.thinking_format()
        if fmt is None:
            return compiled.matcher()
        # a format that always thinks first needs no opening marker to start the thinking
        starts = () if fmt.thinks_first else tuple(fmt.starts)
        token_bytes = await anyio.to_thread.run_sync(compiler.token_bytes)
        opening_ids, opening_row = await anyio.to_thread.run_sync(compiler.opening_tokens, starts)
        return ThinkingGate(
            compiled.matcher(),
            fmt.ends,
            token_bytes,
            msg.prompt_token_ids,
            starts=starts,
            opening_ids=opening_ids,
            opening_row=opening_row,
        )

    async def _add(self, msg: AddRequest) -> Accepted:
        if self.draining or self.sleep.is_sleeping:
            if not self.draining and not self.transition and not self.refreshing:
                self.task_group.start_soon(self._refresh_sleep, None)
            doing = "going to sleep" if self.draining else "asleep"
            return Accepted(
                Rejection(RejectKind.SLEEPING, f"the engine is {doing} and takes no request until it is woken up")
            )
        limit = self.config.max_waiting_seqs
        if self.core.num_waiting >= limit:
            return Accepted(
                Rejection(
                    RejectKind.OVERLOADED,
                    f"the engine already holds {self.core.num_waiting} "
                    f"waiting sequences, its limit (--max-waiting-seqs {limit}); try again later",
                )
            )
        params = msg.params
        pooling = self.info.pooling
        if (msg.pooling is None) != (pooling is None):
            what = "generates no text" if pooling is not None else "is not a pooling model"
            return Accepted(Rejection(RejectKind.INVALID, f"request {msg.request_id!r}: this model {what}"))
        problem = _images_problem(msg, self.info.vision, self.info.hidden_size) or self._whole_media_problem(msg)
        if problem is not None:
            return Accepted(Rejection(RejectKind.INVALID, f"request {msg.request_id!r}: {problem}"))
        try:
            grammar = await self._grammar(msg)
        except InvalidRequestError as exc:
            return Accepted(Rejection(RejectKind.INVALID, str(exc)))
        stop_ids = list(params.stop_token_ids or ())
        if not params.ignore_eos and pooling is None:
            stop_ids += self.info.eos_token_ids
        skip_cache = params.prompt_logprobs is not None
        if msg.pooling is not None and pooling is not None:
            # only the last token's row can come from a step after a prefix-cache hit
            skip_cache = pooling.pooling_type != "last" or not pooling.causal or msg.pooling.task.startswith("token_")
        try:
            request = Request(
                msg.request_id,
                msg.prompt_token_ids,
                max_tokens=1 if msg.pooling is not None else params.max_tokens,
                min_tokens=params.min_tokens,
                stop_token_ids=stop_ids,
                priority=msg.priority,
                arrival_time=msg.arrival_time or time.monotonic(),
                cache_salt=msg.cache_salt,
                lora=msg.lora,
                media=[(im.offset, im.length, im.hash) for im in msg.images],
                media_inputs=msg.images or None,
                sampling_params=params,
                pooling_params=msg.pooling,
                skip_reading_prefix_cache=skip_cache,
                grammar=grammar,
                prompt_embeds=msg.prompt_embeds,
                streams=msg.stream,
            )
            self.core.add_request(request)
        except RequestRejectedError as exc:
            return Accepted(exc.rejection())
        self.pending.append(TrackRequest(msg.request_id, params, msg.prompt_token_ids, msg.sink))
        self.kicked = True
        self.wake.set()
        await self._cut_steps()
        return Accepted()

    async def _cut_steps(self) -> None:
        """A request arrived, or one ended, while a multi-step decode is out: the worker ends it
        after the decode step it is running, so the newcomer waits one decode step, not the rest
        of them (and an ended request's steps are not run for nothing)."""
        if self.multi_step is not None:
            try:
                await self.worker.send(CutSteps(self.multi_step[0]))
            except (ActorError, ActorNotFound):  # the step fails too; the loop recovers
                pass

    async def _stream_tokens(self, msg: StepTokens) -> None:
        """Apply the tokens of a decode step of the multi-step decode out and pass them on, while
        the worker runs its next decode step; one that comes late (the result is back) or out of
        order is dropped, as the result carries its tokens too. A request that ends cuts the
        rest short, as its seat may be taken at once."""
        if self.multi_step is None or msg.step_id != self.multi_step[0] or msg.index != self._streamed_steps:
            return
        self._streamed_steps += 1
        for rid, tokens in msg.sampled.items():
            self._streamed[rid] = self._streamed.get(rid, 0) + len(tokens)
        updates = self.core.update_from_output(msg.sampled, partial=True)
        if not updates:
            return
        if any(u.finish_reason is not None for u in updates):
            await self._cut_steps()
        async with self._outputs_lock:
            await self.detokenizer.send(StepOutputs(new=[], updates=updates, logprobs=msg.logprobs))

    def _whole_media_problem(self, msg: AddRequest) -> str | None:
        """Why the images cannot be computed in one step each (`SchedulerConfig.whole_media`), or
        None; images that touch are refused."""
        config = self.core.config
        limit = config.max_num_batched_tokens
        if not config.whole_media:
            return None
        runs = media_runs((image.offset, image.length) for image in msg.images)
        if len(runs) < len(msg.images):
            # one block of attention, but each image's cache blocks are keyed by its own hash: a
            # hit on the first could bring keys computed beside another second image
            return "images with no token between them are not supported by this model (put a token between)"
        for first, end in runs:
            if end - first > limit:
                return (
                    f"the image tokens at {first}..{end - 1} are {end - first}, more than one step's {limit} "
                    "(--max-num-batched-tokens): this model computes an image's tokens in one step"
                )
        return None

    async def stopping(self) -> None:
        if self.tracer is not None:  # the step spans still queued go out (bounded: a dead collector)
            await anyio.to_thread.run_sync(self.tracer.flush, abandon_on_cancel=True)

    async def run(self) -> None:
        try:
            if self.stages > 1:
                await self._run_stages()
            else:
                await self._run_steps()
        finally:  # stopping: steps still out (async scheduling, stages) are not waited for
            for step in self._sent:
                step.abandon()

    async def _run_steps(self) -> None:
        """The loop with one stage: synchronous, or with async scheduling one step in flight
        besides the one running."""
        in_flight: PendingReply | None = None
        """Async scheduling: the step sent before the last one, its result not fed back yet."""
        in_flight_output: SchedulerOutput | None = None
        while True:
            if self._idle() and in_flight is None:
                await self._wait_for_work()
                continue
            output = await self._schedule()
            if _nothing_to_run(output):
                if in_flight is not None:  # what is left waits for the tokens in flight
                    ok = await self._complete(in_flight)
                    in_flight = None
                    if not ok:
                        await self._recover(in_flight_output)
                    continue
                await self._pause()
                continue
            step = await self._send(output)
            self.steps_overlapped += step is not None and in_flight is not None
            if in_flight is not None:
                # the one token the new step's grammar rows did not know is fed now: its bitmask
                # goes out as soon as it is (and after a failure, for the voided step to end)
                ok = await self._complete(in_flight, bitmask_of=output if step is not None else None)
                if step is not None:
                    await self._send_bitmask(output)
                if not ok:
                    if step is not None:
                        await self._complete(step, apply=False)  # sent after a failed one: void
                    in_flight = None
                    await self._recover(in_flight_output)
                    continue
            elif step is not None:
                await self._send_bitmask(output)
            if step is None:  # the worker could not be reached: the step never ran
                in_flight = None
                await self._recover(None)
            elif self.pipelined:
                in_flight, in_flight_output = step, output
            elif not await self._complete(step):
                await self._recover(output)

    async def _run_stages(self) -> None:
        """The loop with pipeline stages: up to one step per stage in flight, each of requests
        that no other step in flight holds (`SchedulerConfig.pipeline_stages`), so stage 0 starts
        a step while the later stages still run the ones before; results come back in order. A
        failed step voids the ones sent after it."""
        in_flight: deque[tuple[PendingReply, SchedulerOutput]] = deque()
        while True:
            if self._idle() and not in_flight:
                await self._wait_for_work()
                continue
            output = await self._schedule()
            if _nothing_to_run(output):
                if not in_flight:
                    await self._pause()
                    continue
            else:
                step = await self._send(output)
                if step is None:  # the worker could not be reached: this step never ran
                    await self._void(in_flight)
                    await self._recover(None)
                    continue
                await self._send_bitmask(output)  # its requests have no token in flight
                self.steps_overlapped += bool(in_flight)
                in_flight.append((step, output))
                if len(in_flight) < self.stages:
                    continue
            step, sent = in_flight.popleft()
            if not await self._complete(step):
                await self._void(in_flight)
                await self._recover(sent)

    async def _void(self, in_flight: deque[tuple[PendingReply, SchedulerOutput]]) -> None:
        """Wait out the steps sent after a failed one, without applying them."""
        while in_flight:
            await self._complete(in_flight.popleft()[0], apply=False)

    def _idle(self) -> bool:
        return not self.core.has_unfinished_requests() and not self.core.has_pending_kv_transfers()

    async def _wait_for_work(self) -> None:
        self.wake = anyio.Event()
        if self.pending:  # requests admitted and already finished (aborted) still need no step
            self.pending = []
        await self._publish_kv_events()
        await self.wake.wait()

    async def _schedule(self) -> SchedulerOutput:
        if self.updating is not None:  # the steps already sent finish, then the weights change
            await self.updating.wait()
        self.kicked = False
        if self.tracer is not None:
            started = time.monotonic_ns()
            output = self.core.schedule()
            self._scheduled = (started, time.monotonic_ns())
        else:
            output = self.core.schedule()
        await self._publish_kv_events()
        return output

    async def _pause(self) -> None:
        """Nothing could be scheduled this step (the core guarantees progress once blocks free
        up): yield so that aborts and new requests get handled meanwhile."""
        if self.core.loading and not self.kicked:
            # only requests waiting for their KV: a `KVLoaded` (or a new request) wakes us
            self.wake = anyio.Event()
            with anyio.move_on_after(0.05):
                await self.wake.wait()
        else:
            await anyio.sleep(0.001)

    async def _send(self, output: SchedulerOutput) -> PendingReply | None:
        """Send a step to the worker; None when it cannot be delivered."""
        new = []
        for sched in output.requests:
            if sched.is_new:
                req = self.core.get_request(sched.req_id)
                new.append(
                    NewRequestData(
                        sched.req_id,
                        req.sampling_params,
                        req.prompt_token_ids,
                        list(req.output_token_ids),
                        req.lora,
                        req.pooling_params,
                        req.media_inputs or [],
                        req.prompt_embeds,
                    )
                )
        fault = self.faults.next_fault(s.token_ids for s in output.requests) if self.faults is not None else None
        try:
            rows = self._grammar_rows(output)
            if rows:
                self._step_rows[output.step_id] = rows
            action, rank = (fault.action, fault.rank) if fault is not None else (None, 0)
            if self.config.enable_logging_iteration_details:
                self._iterations[output.step_id] = (time.perf_counter(), iteration_details(output))
            if self.shape is not None:
                self._costs[output.step_id] = step_chunks(output)
            if self.config.collect_detailed_traces:
                self._step_requests[output.step_id] = [s.req_id for s in output.requests]
            if self.tracer is not None:
                self._marks[output.step_id] = StepMarks(output, *self._scheduled)
            streamed = self._streamed_ids(output)
            step = await self.worker.ask_soon(
                ExecuteStep(
                    output,
                    new,
                    action,
                    rows,
                    fault_rank=rank,
                    streamed=streamed,
                )
            )
            self._sent.add(step)
            if output.decode_steps > 1:
                self.multi_step = (output.step_id, output.decode_steps)
                self._streamed, self._streamed_steps = {}, 0
            return step
        except (ActorError, ActorNotFound) as exc:
            self._step_rows.pop(output.step_id, None)
            self._iterations.pop(output.step_id, None)
            self._costs.pop(output.step_id, None)
            self._step_requests.pop(output.step_id, None)
            self._marks.pop(output.step_id, None)
            self.failure = exc
            return None

    def _streamed_ids(self, output: SchedulerOutput) -> list[str]:
        """The requests of a multi-step decode whose tokens are handed over as each decode step
        samples them (`StepTokens`): the streams, unless streams hold their tokens back too."""
        if output.decode_steps == 1 or not self.stream_steps:
            return []
        return [s.req_id for s in output.requests if self.core.get_request(s.req_id).streams]

    def _grammar_rows(self, output: SchedulerOutput) -> list[str]:
        """The requests of a step that sample under a grammar, in step order, once per row they
        sample (with drafts, ``1 + num_drafts``)."""
        rows = []
        for sched in output.requests:
            if sched.sample:
                request = self.core.get_request(sched.req_id)
                if request is not None and request.grammar is not None:
                    rows += [sched.req_id] * (1 + sched.num_drafts)
        return rows

    async def _send_bitmask(self, output: SchedulerOutput) -> None:
        """Fill and send the bitmask of a step's grammar rows, from the matchers as they are now:
        every token before the one the step samples has been fed to them. A request that ended
        meanwhile (its token of this step is dropped) allows every token."""
        rows = self._step_rows.pop(output.step_id, None)
        if rows is None:
            return
        if not self._bitmasks or self._bitmasks[0].shape[0] < len(rows):  # drafts add rows
            size = max(self.config.max_num_seqs, len(rows))
            self._bitmasks = [allocate_bitmask(size, self.info.vocab_size) for _ in range(2)]
        buffer = self._bitmasks[self._bitmask_turn]
        self._bitmask_turn ^= 1
        matchers = []
        drafted = []  # (first row, matcher, drafts) of requests whose step carries drafts
        i = 0
        while i < len(rows):
            request = self.core.get_request(rows[i])
            grammar = None if request is None or request.is_finished else request.grammar
            matcher = None if grammar is None or grammar.is_terminated() else grammar
            drafts = request.spec_token_ids if request is not None else []
            if matcher is not None and drafts:
                drafted.append((i, matcher, drafts))
            matchers += [None if drafts else matcher] * (1 + len(drafts))  # drafted rows: filled below
            i += 1 + len(drafts)

        def fill() -> None:
            fill_bitmasks(matchers, buffer)
            for row, matcher, drafts in drafted:
                fill_draft_bitmasks(matcher, drafts, buffer, row)

        # in a thread: a grammar whose masks are slow to compute (a long bounded repetition costs
        # xgrammar ~10 ms a row) must not hold up the mailbox and, in `serve`, the HTTP server
        await anyio.to_thread.run_sync(fill)
        try:
            await self.worker.send(StepBitmask(output.step_id, buffer[: len(rows)]))
        except (ActorError, ActorNotFound):
            pass  # the worker is gone: the step fails, and is recovered, without it

    async def _complete(
        self, step: PendingReply, apply: bool = True, bitmask_of: SchedulerOutput | None = None
    ) -> bool:
        """Wait for a step's result and feed it back (unless `apply` is false); False when the
        step failed (`self.failure` says how). `bitmask_of`: the step sent after this one, whose
        bitmask goes out right after the tokens are fed, before the outputs are passed on."""
        self._sent.discard(step)
        decode_steps = self.multi_step[1] if self.multi_step is not None else 1
        try:  # a multi-step decode may take its decode steps' worth
            result = await step.result(timeout=self.config.step_timeout * decode_steps)
        except (ActorError, AskTimeout, ActorNotFound) as exc:
            self.multi_step = None
            if apply:  # a voided step's failure only follows the one that counts
                self.failure = exc
            self._iterations.clear()  # what is in flight is voided or recomputed
            self._costs.clear()
            self._step_requests.clear()
            self._marks.clear()
            return False
        chunks = self._costs.pop(result.step_id, None)
        stepped = self._step_requests.pop(result.step_id, None)
        marks = self._marks.pop(result.step_id, None)
        runs = 1  # decode steps: those a multi-step decode ran, one token per request each
        if self.multi_step is not None and self.multi_step[0] == result.step_id:
            self.multi_step = None
            runs = max(map(len, result.sampled.values()), default=1)
            if self._streamed:  # what its `StepTokens` brought is applied and passed on already
                result.sampled = {rid: t[self._streamed.get(rid, 0) :] for rid, t in result.sampled.items()}
                result.logprobs = {rid: lp[self._streamed.get(rid, 0) :] for rid, lp in result.logprobs.items()}
        if not apply:
            return True
        self.steps += runs
        self.images_encoded += result.images_encoded
        self.images_reused += result.images_reused
        if chunks is not None and self.mfu is not None and self.shape is not None:
            ranks = self.info.tensor_parallel_size * self.info.pipeline_parallel_size
            for j in range(runs):  # decode step j of a multi-step decode attends to j more positions
                cost = step_cost(self.shape, [(start + j, n, rows) for start, n, rows in chunks])
                self.mfu.flops += cost.flops // ranks
                self.mfu.read_bytes += cost.read_bytes // ranks
            self.mfu.busy_seconds += result.seconds
        iteration = self._iterations.pop(result.step_id, None)
        if iteration is not None:
            sent, details = iteration
            elapsed_ms = round((time.perf_counter() - sent) * 1000, 3)
            worker_ms = round(result.seconds * 1000, 3)
            if runs > 1:  # a multi-step decode: each of its decode steps decoded every request once
                details = {**details, "generation_tokens": details["generation_requests"] * runs, "decode_steps": runs}
            log.info("scheduler.iteration", step=result.step_id, **details, elapsed_ms=elapsed_ms, worker_ms=worker_ms)
        updates = self.core.update_from_output(result.sampled, result.proposed, result.drafted)
        if result.pooled:
            updates += self.core.finish_pooled(result.pooled)
        if bitmask_of is not None:
            await self._send_bitmask(bitmask_of)
        if result.failed:
            for rid, reason in result.failed.items():
                log.error("request.sampling_failed", request=rid, reason=reason)
            lost = set(result.uncache)
            updates += self.core.fail_requests(
                {
                    rid: RequestError("lora" if rid in lost else "sampling", f"request {rid!r}: {reason}")
                    for rid, reason in result.failed.items()
                },
                uncache=lost,
            )
        if stepped is not None:
            # the step's span ends once its tokens are fed back: what it served is known
            ref = None
            if marks is not None and self.tracer is not None:
                ref = self.tracer.record(marks, result, time.monotonic_ns())
            self._add_model_time(stepped, result, updates, ref)
        tracked, self.pending = self.pending, []
        # a prefill chunk that samples nothing still carries its prompt logprobs
        if updates or tracked or result.prompt_logprobs:
            async with self._outputs_lock:
                await self.detokenizer.send(
                    StepOutputs(
                        new=tracked,
                        updates=updates,
                        logprobs=result.logprobs,
                        prompt_logprobs=result.prompt_logprobs,
                        pooled=result.pooled,
                    )
                )
        return True

    def _add_model_time(
        self, stepped: list[str], result: StepResult, updates: list[RequestUpdate], ref: StepRef | None
    ) -> None:
        """--collect-detailed-traces: add a step's worker time to each of its requests, and give
        every update its request's total so far (a stop string or an abort ends a request on the
        frontend's side with the last one it got). With step spans (`ref`: this step's), each
        update also carries the request's step count and the step spans it has not been given yet,
        the first `MAX_STEP_LINKS` only."""
        times, links = self._model_time, self._links
        for rid in stepped:
            acc = times.setdefault(rid, [0.0, 0.0, 0])
            acc[0] += result.seconds
            acc[1] += result.forward_seconds
            acc[2] += 1
            if ref is not None and acc[2] <= MAX_STEP_LINKS:
                links.setdefault(rid, []).append(ref)
        worker, model = self.config.trace_worker, self.config.trace_model
        for update in updates:
            acc = times.get(update.req_id)
            if acc is not None:
                update.model_time = RequestModelTime(
                    acc[0] if worker else None,
                    acc[1] if model else None,
                    int(acc[2]) if self.tracer is not None else 0,
                    links.pop(update.req_id, []),
                )
        if len(times) > len(self.core.requests):  # ended requests (finished, stopped, aborted) go
            for rid in [rid for rid in times if rid not in self.core.requests]:
                del times[rid]
                links.pop(rid, None)

    # -- KV offloading -------------------------------------------------------------------------
    def _in_tiers(self, block_hash: bytes) -> bool:
        refs = self.tiers.refs
        return any(block_hash in refs.get(medium, ()) for medium in TIER_MEDIA)

    def _lookup(self, request: Request) -> int:
        """Leading blocks of `request` whose chunks the lower tiers hold (by the mirror)."""
        hashes = request.block_hashes
        bpc = self.offload_bpc
        n = 0
        while n + bpc <= len(hashes) and self._in_tiers(hashes[n + bpc - 1]):
            n += bpc
        return n

    def _apply_tier_update(self, update: TierUpdate) -> None:
        bm = self.core.block_manager
        if update.snapshot is not None:
            index = KVBlockIndex()
            for medium, hashes in update.snapshot.items():
                refs = index.refs.setdefault(medium, {})
                for h in hashes:
                    refs[h] = refs.get(h, 0) + 1
            self.tiers = index
            cleared = True
        else:
            cleared = False
            gone: list[bytes] = []
            for event in update.events:
                self.tiers.apply(event)
                if isinstance(event, BlockRemoved):
                    gone += event.block_hashes
                elif isinstance(event, AllBlocksCleared):
                    cleared = True
            if gone and not cleared:
                bm.forget_offloaded([h for h in gone if not self._in_tiers(h)])
        if cleared:  # the tiers lost chunks wholesale: offer again what they no longer hold
            bm.forget_offloaded([h for h in bm.offloaded_keys if not self._in_tiers(h)])
        self.tier_epoch, self.tier_seq = update.epoch, update.seq

    async def _watch_tiers(self) -> None:
        """Keep the tier mirror: long-poll the manager's tier events (a snapshot after a restart)."""
        while True:
            try:
                update = await self.offload.ask(WatchTiers(self.tier_epoch, self.tier_seq, 5.0), timeout=30)
            except (ActorError, AskTimeout, ActorNotFound):
                await anyio.sleep(0.2)  # the manager is restarting; its successor sends a snapshot
                continue
            self._apply_tier_update(update)

    async def _publish_kv_events(self) -> None:
        if self.kv_events:
            events = self.core.block_manager.take_kv_events()
            if events:
                await self._send_offload(PublishEvents(events))

    async def _send_offload(self, msg: Any) -> None:
        try:
            await self.offload.send(msg)
        except ActorNotFound:  # the manager is restarting: these events are lost
            log.warning("scheduler.kv_events_dropped", detail="offload manager unavailable")

    async def _recover(self, failed: SchedulerOutput | None) -> None:
        """The step `failed` failed (`self.failure`; None: no step reached the worker): quarantine
        what the core convicts, recompute everything else in flight once the worker answers
        again."""
        never_ran = _never_ran(self.failure)
        crashed = [] if failed is None or never_ran else [r.req_id for r in failed.requests]
        recovery = self.core.reset_after_worker_failure(crashed)
        ids = recovery.recomputed
        log.error(
            "scheduler.step_failed",
            detail="requests will be recomputed",
            error=str(self.failure),
            requests=len(ids),
            suspects=len(self.core.quarantine),
        )
        if recovery.quarantined:
            for update in recovery.quarantined:
                log.error("request.quarantined", request=update.req_id)
            # requests that never had a step back are not tracked by the detokenizer yet
            tracked, self.pending = self.pending, []
            await self.detokenizer.send(StepOutputs(new=tracked, updates=recovery.quarantined))
        delay = 0.05
        # A worker that failed in a step is on its way out and may still answer for a moment: a
        # step sent to it then would fail too, and count against the requests of that step.
        failed_worker = None if never_ran else self.info.instance
        grace = time.monotonic() + SAME_WORKER_GRACE
        while True:
            try:
                info = await self.worker.ask(DescribeWorker(), timeout=5)
                if info.instance != failed_worker or time.monotonic() > grace:
                    break
            except (ActorError, AskTimeout, ActorNotFound):
                pass
            await anyio.sleep(delay)
            delay = min(delay * 2, 1.0)
        if (info.num_blocks, info.block_size) != (self.info.num_blocks, self.info.block_size):
            raise RuntimeError("the restarted worker has a different KV cache layout")
        self.info = info
        log.info("scheduler.worker_back", requests=len(ids))

    # -- sleep mode --------------------------------------------------------------------------------
    async def _refresh_sleep(self, msg: GetSleepState | None) -> None:
        """While asleep, take the worker's own state (and answer it to `msg`): a worker restarted
        meanwhile (it crashed) starts awake, whole, and then so does this scheduler. Asked by
        `GetSleepState`, and by a request refused while asleep (the next one may be served)."""
        self.refreshing = True
        try:
            info = await self.worker.ask(DescribeWorker(), timeout=5)
        except (ActorError, AskTimeout, ActorNotFound):
            info = None  # restarting: the state stays as it was
        finally:
            self.refreshing = False
        if info is not None and not self.transition and info.instance != self.info.instance:
            if (info.num_blocks, info.block_size) != (self.info.num_blocks, self.info.block_size):
                raise RuntimeError("the restarted worker has a different KV cache layout")
            log.warning("scheduler.worker_restarted", sleeping=info.sleep.is_sleeping)
            self.info, self.sleep = info, info.sleep
        if msg is not None and msg.reply_to is not None:
            await get_node().reply(msg.reply_to, SleepReply(self.sleep))

    async def _go_to_sleep(self, msg: SleepEngine) -> None:
        reply = SleepReply(self.sleep)
        try:
            try:
                if plan_sleep(self.sleep, msg.level) is not None:
                    reply = await self._sleep(msg)
            except SleepRefusedError as exc:
                reply = SleepReply(self.sleep, str(exc))
        finally:
            self.transition = False
        if msg.reply_to is not None:
            await get_node().reply(msg.reply_to, reply)

    async def _sleep(self, msg: SleepEngine) -> SleepReply:
        """Drain, drop the prefix cache, put the worker to sleep."""
        self.draining = True
        try:
            with anyio.move_on_after(msg.drain_timeout):
                while not (self._idle() and not self.pending):
                    await anyio.sleep(0.01)
            running = len(self.core.requests) + len(self.pending)
            if running:
                log.warning("scheduler.sleep_refused", requests=running, drain_timeout=msg.drain_timeout)
                return SleepReply(
                    self.sleep,
                    f"{running} request(s) still running after the drain timeout of {msg.drain_timeout:g} s; "
                    "the engine stays awake",
                )
            self.core.block_manager.reset_prefix_cache()
            await self._publish_kv_events()
            try:
                self.sleep = await self.worker.ask(Sleep(msg.level), timeout=self.config.step_timeout)
            except (ActorError, AskTimeout, ActorNotFound) as exc:
                return SleepReply(self.sleep, f"the worker could not go to sleep: {exc}")
        finally:
            self.draining = False
        log.info("scheduler.asleep", level=msg.level)
        return SleepReply(self.sleep)

    async def _wake_up(self, msg: WakeEngine) -> None:
        try:
            try:
                self.sleep = await self.worker.ask(WakeUp(msg.tags), timeout=self.config.step_timeout)
                reply = SleepReply(self.sleep)
            except (ActorError, AskTimeout, ActorNotFound) as exc:
                reply = SleepReply(self.sleep, f"the worker could not wake up: {exc}")
        finally:
            self.transition = False
        if not self.sleep.is_sleeping:
            log.info("scheduler.awake")
        if msg.reply_to is not None:
            await get_node().reply(msg.reply_to, reply)

    async def _update_weights(self, msg: UpdateEngineWeights) -> None:
        """Have the worker write new weights between steps, then drop the prefix cache."""
        assert self.updating is not None
        try:
            update = UpdateWeights(msg.path, msg.tensors)
            updated = await self.worker.ask(update, timeout=self.config.step_timeout)
            self.core.block_manager.drop_stale_kv()
            await self._publish_kv_events()
            reply = WeightUpdateReply(updated)
            log.info("scheduler.weights_updated", tensors=updated.tensors, seconds=updated.seconds)
        except ActorError as exc:
            refused = exc.error.type.endswith((".WeightUpdateError", ".WeightUpdateConflictError", ".NotEnabledError"))
            reply = WeightUpdateReply(
                refused=exc.error.message if refused else None,
                failed=None if refused else f"the worker failed while it wrote the weights: {exc.error.message}",
                conflict=exc.error.type.endswith(".WeightUpdateConflictError"),
            )
        except (AskTimeout, ActorNotFound) as exc:
            reply = WeightUpdateReply(failed=f"the worker could not update its weights: {exc}")
        finally:
            self.updating.set()
            self.updating = None
        if msg.reply_to is not None:
            await get_node().reply(msg.reply_to, reply)


#: Bytes per weight and KV value, by the model's dtype (quantized weights are counted at it too).
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def step_chunks(output: SchedulerOutput) -> list[tuple[int, int, int]]:
    """Each request's ``(start, tokens, sampled rows)`` in a step, for `step_cost`."""
    return [(s.start_pos, len(s.token_ids), 1 + s.num_drafts if s.sample else 0) for s in output.requests]


def _nothing_to_run(output: SchedulerOutput) -> bool:
    return output.is_empty and not output.finished_req_ids and not output.has_kv_transfers


def _never_ran(failure: Exception | None) -> bool:
    """The step failed without running: no worker took it (its mailbox was gone), or the worker
    refused it as meant for its predecessor (it names requests the worker does not hold). Its
    requests did not make it fail, and the worker did not crash."""
    if isinstance(failure, ActorNotFound):
        return True
    return isinstance(failure, ActorError) and failure.error.type.endswith((".ActorNotFound", ".UnknownRequestError"))


def _image_shape(image: ImageInput, vision: VisionInfo, hidden_size: int) -> tuple[int | None, tuple[int, ...] | None]:
    """The tokens and the pixel (or feature row) shape `image` must have on this model (Nones: a
    grid that cannot be)."""
    width = vision.feature_width or hidden_size
    if vision.grid_pinpoints:
        return _tiles_shape(image, vision, width)
    if not vision.patch_size:
        side = vision.image_size
        tokens = vision.tokens_per_image
        return tokens, (tokens, width) if image.embeds else (3, side, side)
    grid, merge = image.grid, vision.merge_size
    if grid is None or len(grid) != 3 or grid[0] != 1 or min(grid) <= 0 or grid[1] % merge or grid[2] % merge:
        return None, None
    t, h, w = grid
    tokens = t * h * w // merge**2
    return tokens, (tokens, width) if image.embeds else (
        t * h * w,
        3 * vision.temporal_patch_size * vision.patch_size**2,
    )


def _tiles_shape(image: ImageInput, vision: VisionInfo, width: int) -> tuple[int | None, tuple[int, ...] | None]:
    """`_image_shape` for an any-resolution model: an image's tokens follow from its original size
    (its grid), its pixels are its tiles; feature rows may be of any count."""
    if image.embeds:
        return image.length, (image.length, width)
    size = image.grid
    if size is None or len(size) != 2 or min(size) <= 0:
        return None, None
    tile, pinpoints = vision.image_size, vision.grid_pinpoints or []
    tokens = feature_rows((size[0], size[1]), pinpoints, tile, vision.tile_patch_size)
    return tokens, (num_tiles((size[0], size[1]), pinpoints, tile), 3, tile, tile)


def _images_problem(msg: AddRequest, vision: VisionInfo | None, hidden_size: int) -> str | None:
    """Why the request's images cannot run on this model, or None: each must sit on exactly
    `tokens_per_image` image tokens of the prompt, in order, with pixels of the tower's size (or
    feature rows of the model's width), and no image token may be left without its image."""
    prompt = msg.prompt_token_ids
    if vision is None:
        return "this model does not accept images" if msg.images else None
    end = 0
    for i, image in enumerate(msg.images):
        length, shape = _image_shape(image, vision, hidden_size)
        if length is None or shape is None:
            if vision.grid_pinpoints:
                return f"image {i} needs its (height, width) in pixels"
            return f"image {i} needs a grid (1, h, w) of patches, h and w multiples of {vision.merge_size} (videos are not served)"
        if image.offset < end or image.length != length or image.offset + image.length > len(prompt):
            return f"image {i} does not fit the prompt's image tokens"
        if any(t != vision.image_token_id for t in prompt[image.offset : image.offset + image.length]):
            return f"image {i} is not placed on image tokens"
        pixels = image.pixel_values
        if tuple(getattr(pixels, "shape", ())) != shape or str(pixels.dtype) != "torch.float32":
            return (
                f"image {i} has pixels of shape {tuple(getattr(pixels, 'shape', ()))}, the model takes {shape} float32"
            )
        end = image.offset + image.length
    placed = sum(image.length for image in msg.images)
    if prompt.count(vision.image_token_id) != placed:
        return f"the prompt holds image tokens (id {vision.image_token_id}) without their image"
    return None
