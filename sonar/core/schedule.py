"""The scheduler core: one token budget per step over running and waiting requests.

A step (``Scheduler.schedule``) spends ``max_num_batched_tokens`` in this order:

1. running requests that decode (one token each), most important first;
2. running requests in the middle of a chunked prefill;
3. waiting requests (new, or preempted and resumed), in policy order, while fewer than
   ``max_num_seqs`` run; a prefix-cache hit skips the cached tokens.

When a running request cannot get a block, the least important running request (the last of
the running list, see ``sonar.core.policy``) is preempted: its blocks are freed and it goes
back to the front of the waiting queue, to be recomputed later. A step that preempted
admits nobody. ``update_from_output`` then appends the sampled tokens and finishes
requests on a stop token, ``max_tokens`` or ``max_model_len``.

A step is assumed to have run before the next ``schedule`` call's step runs (the worker
executes steps in order), so blocks freed in one call can be reused by the next.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from sonar.core.blocks import BlockManager
from sonar.core.outputs import RequestUpdate, ScheduledRequest, SchedulerOutput, SchedulerStats
from sonar.core.policy import POLICIES, make_waiting_queue, policy_key
from sonar.core.request import (
    DuplicateRequestError,
    PromptTooLongError,
    Request,
    RequestStatus,
)

__all__ = ["Scheduler", "SchedulerConfig"]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Scheduler flags (``--max-num-batched-tokens`` and friends), validated."""

    max_model_len: int
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    """With chunked prefill, the most prompt tokens one request computes per step; 0: no cap."""
    scheduling_policy: str = "fcfs"
    watermark: float = 0.0
    """Fraction of all KV blocks that must stay free after admitting a waiting request."""
    scheduler_reserve_full_isl: bool = True
    """Admit a request only if its whole input fits in the free KV blocks, not just the
    first chunk (the rest is checked, not reserved)."""

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be 0 (no cap) or positive, got "
                f"{self.long_prefill_token_threshold}"
            )
        if self.scheduling_policy not in POLICIES:
            raise ValueError(
                f"unknown scheduling policy {self.scheduling_policy!r}; choose one of "
                f"{', '.join(POLICIES)}"
            )
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0.0, 1.0), got {self.watermark}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs})"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be at least max_model_len ({self.max_model_len}) so every prompt fits a step"
            )


_RUNNING = RequestStatus.RUNNING


class Scheduler:
    """Owns every unfinished request, the waiting queue, the running list and the KV blocks."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        needed = block_manager.blocks_for(config.max_model_len)
        if needed > block_manager.num_blocks:
            raise ValueError(
                f"max_model_len {config.max_model_len} needs {needed} KV blocks of "
                f"{block_manager.block_size} tokens but the cache has {block_manager.num_blocks}; "
                "lower max_model_len or give the KV cache more memory"
            )
        self.config = config
        self.block_manager = block_manager
        self.requests: dict[str, Request] = {}
        self._key = policy_key(config.scheduling_policy)
        self.waiting = make_waiting_queue(config.scheduling_policy)
        self.running: list[Request] = []
        """Sorted by the policy key: most important first, the next victim last."""
        self._arrivals = itertools.count()
        self._step_ids = itertools.count()
        self._finished_ids: list[str] = []
        self._watermark_blocks = int(config.watermark * block_manager.num_blocks + 1e-9)
        self.num_preemptions = 0

    # Requests in and out.

    def add_request(self, request: Request) -> None:
        """Queue ``request``; raise ``PromptTooLongError`` / ``DuplicateRequestError`` first."""
        if request.num_tokens > self.config.max_model_len:
            raise PromptTooLongError(
                request.request_id, request.num_tokens, self.config.max_model_len
            )
        if request.request_id in self.requests:
            raise DuplicateRequestError(request.request_id)
        request.seq = next(self._arrivals)
        request.status = RequestStatus.WAITING
        self.block_manager.update_hashes(request)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort(self, request_ids: Iterable[str]) -> list[str]:
        """Abort requests wherever they are; return the ids that were found."""
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(
        self,
        request_ids: Iterable[str],
        status: RequestStatus,
        stop_reason: int | str | None = None,
    ) -> list[str]:
        """Finish requests from outside (abort, a stop string found by the detokenizer).

        Their blocks are freed at once and their ids reach the runner with the next step.
        Unknown or already finished ids are ignored; the found ones are returned.
        """
        if not status.is_finished:
            raise ValueError(f"{status.name} is not a finished status")
        found = []
        finished_running = False
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == _RUNNING:
                self.block_manager.free(request_id)
                finished_running = True
            else:
                self.waiting.remove(request)
            request.status = status
            request.stop_reason = stop_reason
            self._retire(request)
            found.append(request_id)
        if finished_running:
            self.running = [r for r in self.running if r.status == _RUNNING]
        return found

    def _retire(self, request: Request) -> None:
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)

    # One step.

    def schedule(self) -> SchedulerOutput:
        """Choose the work of the next step within the token budget and the KV cache."""
        config = self.config
        bm = self.block_manager
        budget = config.max_num_batched_tokens
        threshold = config.long_prefill_token_threshold if config.enable_chunked_prefill else 0
        scheduled: dict[str, int] = {}
        admitted: set[str] = set()
        preempted: list[str] = []
        running = self.running

        for decodes in (True, False):
            i = 0
            while i < len(running) and budget > 0:
                request = running[i]
                remaining = len(request.all_token_ids) - request.num_computed_tokens
                if remaining <= 0 or (remaining == 1) != decodes or request.request_id in scheduled:
                    i += 1
                    continue
                num_new = remaining
                if threshold and num_new > threshold:
                    num_new = threshold
                if num_new > budget:
                    num_new = budget
                while not bm.allocate_slots(request, num_new):
                    victim = running.pop()
                    budget += scheduled.pop(victim.request_id, 0)
                    self._preempt(victim)
                    preempted.append(victim.request_id)
                    if victim is request:
                        break
                else:
                    scheduled[request.request_id] = num_new
                    budget -= num_new
                    i += 1

        if not preempted:
            budget = self._admit(budget, threshold, scheduled, admitted)

        step = []
        total = 0
        for request_id, num_new in scheduled.items():
            request = self.requests[request_id]
            start = request.num_computed_tokens
            end = start + num_new
            step.append(
                ScheduledRequest(
                    request_id,
                    request.all_token_ids[start:end],
                    start,
                    bm.block_ids(request_id).copy(),
                    end == len(request.all_token_ids),
                    request_id in admitted,
                    request.num_prompt_tokens,
                )
            )
            request.num_computed_tokens = end
            total += num_new
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(next(self._step_ids), step, total, preempted, finished)

    def _admit(
        self, budget: int, threshold: int, scheduled: dict[str, int], admitted: set[str]
    ) -> int:
        config = self.config
        bm = self.block_manager
        waiting = self.waiting
        reserve_full = config.scheduler_reserve_full_isl
        # The watermark is waived while nothing runs, so a request that needs nearly the
        # whole cache is still admitted once it is alone.
        while len(waiting) and budget > 0 and len(self.running) < config.max_num_seqs:
            request = waiting.peek()
            if request.skip_reading_prefix_cache:
                hits, num_hit_tokens = [], 0
            else:
                hits, num_hit_tokens = bm.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit_tokens
            if config.enable_chunked_prefill:
                if threshold and num_new > threshold:
                    num_new = threshold
                if num_new > budget:
                    num_new = budget
            elif num_new > budget:
                break
            if not bm.allocate_slots(
                request,
                num_new,
                new_computed_blocks=hits,
                reserve_tokens=request.num_tokens if reserve_full else 0,
                keep_free_blocks=self._watermark_blocks if self.running else 0,
            ):
                break
            waiting.pop()
            request.status = _RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            bisect.insort(self.running, request, key=self._key)
            scheduled[request.request_id] = num_new
            admitted.add(request.request_id)
            budget -= num_new
        return budget

    def _preempt(self, request: Request) -> None:
        """Send a running request (already off the running list) back to the waiting queue."""
        self.block_manager.free(
            request.request_id, num_computed_tokens=request.num_computed_tokens
        )
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_preempted(request)

    # Results of a step.

    def update_from_output(
        self,
        sampled: Mapping[str, Sequence[int]],
        stopped: Mapping[str, int | str | None] | None = None,
    ) -> list[RequestUpdate]:
        """Apply a step's results: append sampled tokens, finish what ended, free its blocks.

        ``sampled`` maps request id to the tokens sampled for it this step (usually one).
        A request finishes on a token in its ``stop_token_ids`` (once ``min_tokens`` are
        out), on reaching ``max_tokens``, or on reaching ``max_model_len``; later tokens
        of the same step are dropped. ``stopped`` names requests that ended for a reason
        found outside (a stop string), with that reason. Ids no longer running (aborted
        meanwhile) are ignored. Returns one update per request that got tokens or ended.
        """
        max_model_len = self.config.max_model_len
        bm = self.block_manager
        updates: list[RequestUpdate] = []
        any_finished = False
        for request_id, token_ids in sampled.items():
            request = self.requests.get(request_id)
            if request is None or request.status != _RUNNING or not token_ids:
                continue
            output = request.output_token_ids
            all_ids = request.all_token_ids
            first = len(output)
            for token in token_ids:
                output.append(token)
                all_ids.append(token)
                if token in request.stop_token_ids and len(output) >= request.min_tokens:
                    request.status = RequestStatus.FINISHED_STOPPED
                    request.stop_reason = token
                    break
                if len(all_ids) >= max_model_len or (
                    request.max_tokens is not None and len(output) >= request.max_tokens
                ):
                    request.status = RequestStatus.FINISHED_LENGTH
                    break
            if stopped is not None and request_id in stopped and request.status == _RUNNING:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = stopped[request_id]
            if request.status == _RUNNING:
                bm.update_hashes(request)
            else:
                bm.free(request_id)
                self._retire(request)
                any_finished = True
            updates.append(self._update(request, output[first:]))
        if stopped:
            for request_id, reason in stopped.items():
                request = self.requests.get(request_id)
                if request is not None:
                    self.finish_requests([request_id], RequestStatus.FINISHED_STOPPED, reason)
                    updates.append(self._update(request, []))
        if any_finished:
            self.running = [r for r in self.running if r.status == _RUNNING]
        return updates

    @staticmethod
    def _update(request: Request, new_token_ids: list[int]) -> RequestUpdate:
        return RequestUpdate(
            request.request_id,
            new_token_ids,
            request.status.finish_reason,
            request.stop_reason,
            request.num_prompt_tokens,
            max(request.num_cached_tokens, 0),
        )

    def reset_after_worker_failure(self) -> list[str]:
        """Preempt every running request and forget the prefix cache; return their ids.

        After a worker crash the KV of the steps in flight is lost; the requests are
        recomputed from their tokens, in their original order.
        """
        ids = []
        while self.running:
            request = self.running.pop()
            self._preempt(request)
            ids.append(request.request_id)
        self.block_manager.reset_prefix_cache()
        return ids

    # Introspection.

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def stats(self) -> SchedulerStats:
        bm = self.block_manager
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preemptions=self.num_preemptions,
            kv_usage=bm.usage(),
            num_free_blocks=bm.num_free_blocks,
            prefix_queries=bm.prefix_queries,
            prefix_hits=bm.prefix_hits,
        )

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` unless queues, statuses and block tables agree."""
        bm = self.block_manager
        bm.check_invariants()
        running_ids = [r.request_id for r in self.running]
        waiting_ids = [r.request_id for r in self.waiting]
        if len(self.running) > self.config.max_num_seqs:
            raise AssertionError(f"{len(self.running)} running, above max_num_seqs")
        if sorted(running_ids + waiting_ids) != sorted(self.requests):
            raise AssertionError("a request is missing from, or duplicated in, the queues")
        keys = [self._key(r) for r in self.running]
        if keys != sorted(keys):  # type: ignore[type-var]
            raise AssertionError("the running list is out of policy order")
        if sorted(bm.request_ids()) != sorted(running_ids):
            raise AssertionError("block tables do not belong to exactly the running requests")
        for request in self.running:
            if request.status != _RUNNING:
                raise AssertionError(f"{request!r} is on the running list")
            held = bm.num_request_blocks(request.request_id)
            if held < bm.blocks_for(request.num_computed_tokens):
                raise AssertionError(f"{request!r} has too few blocks for its computed tokens")
        for request in self.waiting:
            if request.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                raise AssertionError(f"{request!r} is in the waiting queue")
            if request.num_computed_tokens:
                raise AssertionError(f"{request!r} waits with computed tokens")
        for request in self.requests.values():
            if request.num_computed_tokens > request.num_tokens:
                raise AssertionError(f"{request!r} computed more tokens than it has")
