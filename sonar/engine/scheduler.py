"""The scheduler actor: a thin shell around `sonar.core.Scheduler`.

Requests come in through the mailbox (`AddRequest`, `Abort`, `StopStringHit`); the step loop
runs beside it in `run()`: schedule, ask the worker to execute, feed the sampled tokens back into
the core, and pass what happened to the detokenizer. When a step fails (the worker crashed, hung
or was restarted), every running request is preempted and recomputed once the worker answers
again: clients see a pause, not an error.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import msgspec

from sonar.actors import Actor, ActorError, ActorNotFound, ActorRef, AskTimeout
from sonar.core import BlockManager, Request, RequestRejectedError, Scheduler, SchedulerConfig
from sonar.core.request import DuplicateRequestError, PromptTooLongError, RequestStatus
from sonar.engine.config import EngineConfig
from sonar.engine.protocol import (
    Abort,
    Accepted,
    AddRequest,
    DescribeWorker,
    ExecuteStep,
    Forget,
    GetStats,
    NewRequestData,
    SchedulerMsg,
    StepOutputs,
    StopStringHit,
    TrackRequest,
    WorkerInfo,
)
from sonar.log import get_logger

log = get_logger("sonar.scheduler")


class SchedulerActor(Actor):
    protocol = SchedulerMsg

    def __init__(self, config: dict[str, Any], worker: ActorRef, detokenizer: ActorRef) -> None:
        self.config = msgspec.convert(config, EngineConfig)
        self.worker = worker
        self.detokenizer = detokenizer
        self.pending: list[TrackRequest] = []
        self.wake = anyio.Event()
        self.steps = 0

    async def started(self) -> None:
        info: WorkerInfo = await self.worker.ask(DescribeWorker(), timeout=60)
        self.info = info
        cfg = self.config
        blocks = BlockManager(info.num_blocks, info.block_size, enable_prefix_caching=cfg.enable_prefix_caching,
                              hash_algo=cfg.prefix_caching_hash_algo)
        self.core = Scheduler(SchedulerConfig(
            max_model_len=info.max_model_len,
            max_num_batched_tokens=max(cfg.max_num_batched_tokens, cfg.max_num_seqs),
            max_num_seqs=cfg.max_num_seqs,
            enable_chunked_prefill=cfg.enable_chunked_prefill,
            long_prefill_token_threshold=cfg.long_prefill_token_threshold,
            scheduling_policy=cfg.scheduling_policy,
            watermark=cfg.watermark,
            scheduler_reserve_full_isl=cfg.scheduler_reserve_full_isl,
        ), blocks)

    async def handle(self, msg: SchedulerMsg) -> Any:
        if isinstance(msg, AddRequest):
            return self._add(msg)
        if isinstance(msg, Abort):
            found = self.core.abort(msg.request_ids)
            dropped = {t.req_id for t in self.pending} & set(msg.request_ids)
            self.pending = [t for t in self.pending if t.req_id not in dropped]
            if found:
                await self.detokenizer.send(Forget(found))
            return None
        if isinstance(msg, StopStringHit):
            for rid, stop in msg.hits.items():
                self.core.finish_requests([rid], RequestStatus.FINISHED_STOPPED, stop_reason=stop)
            return None
        if isinstance(msg, GetStats):
            return self.core.stats()
        raise TypeError(f"unexpected {type(msg).__name__}")

    def _add(self, msg: AddRequest) -> Accepted:
        params = msg.params
        stop_ids = list(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids += self.info.eos_token_ids
        try:
            request = Request(
                msg.request_id, msg.prompt_token_ids, max_tokens=params.max_tokens, min_tokens=params.min_tokens,
                stop_token_ids=stop_ids, priority=msg.priority, arrival_time=msg.arrival_time or time.monotonic(),
                cache_salt=msg.cache_salt, sampling_params=params,
                skip_reading_prefix_cache=params.prompt_logprobs is not None,
            )
            self.core.add_request(request)
        except PromptTooLongError as exc:
            return Accepted(False, str(exc), "too_long")
        except DuplicateRequestError as exc:
            return Accepted(False, str(exc), "duplicate")
        except RequestRejectedError as exc:
            return Accepted(False, str(exc), "invalid")
        self.pending.append(TrackRequest(msg.request_id, params, msg.prompt_token_ids, msg.sink))
        self.wake.set()
        return Accepted(True)

    async def run(self) -> None:
        while True:
            if not self.core.has_unfinished_requests():
                self.wake = anyio.Event()
                if self.pending:  # requests admitted and already finished (aborted) still need no step
                    self.pending = []
                await self.wake.wait()
                continue
            output = self.core.schedule()
            if output.is_empty and not output.finished_req_ids:
                # Nothing could be scheduled this step (the core guarantees progress once blocks
                # free up); yield so that aborts and new requests get handled meanwhile.
                await anyio.sleep(0.001)
                continue
            new = []
            for sched in output.requests:
                if sched.is_new:
                    req = self.core.get_request(sched.req_id)
                    new.append(NewRequestData(sched.req_id, req.sampling_params, req.prompt_token_ids,
                                              list(req.output_token_ids)))
            try:
                result = await self.worker.ask(ExecuteStep(output, new), timeout=self.config.step_timeout)
            except (ActorError, AskTimeout, ActorNotFound) as exc:
                await self._recover(exc)
                continue
            self.steps += 1
            updates = self.core.update_from_output(result.sampled)
            tracked, self.pending = self.pending, []
            # a prefill chunk that samples nothing still carries its prompt logprobs
            if updates or tracked or result.prompt_logprobs:
                await self.detokenizer.send(StepOutputs(
                    new=tracked, updates=updates, scheduler=self.ref, logprobs=result.logprobs,
                    prompt_logprobs=result.prompt_logprobs,
                ))

    async def _recover(self, exc: Exception) -> None:
        """The step failed: recompute everything in flight once the worker answers again."""
        ids = self.core.reset_after_worker_failure()
        log.error("step failed; requests will be recomputed", error=str(exc), requests=len(ids))
        delay = 0.05
        while True:
            try:
                info = await self.worker.ask(DescribeWorker(), timeout=5)
                break
            except (ActorError, AskTimeout, ActorNotFound):
                await anyio.sleep(delay)
                delay = min(delay * 2, 1.0)
        if (info.num_blocks, info.block_size) != (self.info.num_blocks, self.info.block_size):
            raise RuntimeError("the restarted worker has a different KV cache layout")
        log.info("worker back; resuming", requests=len(ids))
