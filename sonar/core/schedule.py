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

Async scheduling: the shell may call ``schedule`` for step N+1 before ``update_from_output``
of step N. Each token a scheduled step will sample counts as a placeholder of its request
(``Request.num_placeholders``) until its result comes back: the request's next decode feeds
`PLACEHOLDER_TOKEN` at that position (the runner puts in the token it sampled), and a request
whose tokens in flight are sure to end it (``max_tokens``, ``max_model_len``) is not scheduled
again. One that ends on a stop token computes one token more, which is dropped; one preempted
while in flight still gets the token it was computing. In the synchronous loop every
placeholder is resolved before the next ``schedule``, and nothing changes. With
``pipeline_stages`` > 1 a request with a placeholder is not scheduled at all until its token is
back, so no step carries a placeholder and several steps (micro-batches) may be in flight.

Multi-step decode (``SchedulerConfig.decode_steps``): a step of plain decodes, with nothing waiting,
may decode several tokens per request back to back on the worker; ``update_from_output`` takes
back the positions of those a worker that stopped early did not compute.

Speculative decoding (``SchedulerConfig.speculative``): a decoding request may carry drafts from
the proposer (`sonar.core.speculative`), or from the worker's draft model or EAGLE head (with the
step before, plus ``lookahead`` KV slots for the draft's own KV), after its last token; they take
budget and KV slots like any token. ``update_from_output`` takes the drafts the runner kept plus its sampled token, and
moves the request's computed tokens back to the last of them, so the KV of rejected drafts is
overwritten by the tokens that follow (their slots stay the request's). A request with a token in
flight (async scheduling) gets no drafts from the core; with ``worker_drafts`` (async scheduling
with ngram or suffix) it gets draft slots that the worker fills, placed as if every draft in flight
were kept, and ``update_from_output`` gives back what a step did not keep. A request's grammar cuts
its drafts to what it allows (`GrammarMatcher.valid_prefix`). Speculation backs off where it does not
pay: a request whose drafts were all rejected runs 1, 2, 4 .. `MAX_SPEC_SKIP` decode steps without
drafts before it proposes again (one accepted draft resets it).

KV offloading (``lower_tier_lookup`` given, and a block manager with
``offload_blocks_per_chunk``): a waiting request whose prefix continues, past its prefix-cache
hits, in the offload tiers is admitted with blocks for that part and parked as
``WAITING_FOR_KV``: it spends no token budget and does not block the requests behind it. The
step's ``kv_loads`` tell the runner what to load; ``finish_kv_load`` (called when the runner
reports back) caches the loaded blocks and moves the request to the running list, where it
computes the rest. Blocks that could not be loaded are simply recomputed. Freed requests offer
their computed chunks (``kv_stores``) for offloading.

Worker crashes (``reset_after_worker_failure``): the requests of the failed step become suspects
(`sonar.core.quarantine`); ``_admit`` lets at most one suspect run at a time, beside requests that
are not suspects, and a suspect that fails a step alone is quarantined: it finishes with
``FINISHED_ERROR`` and the others go on. ``fail_requests`` ends requests the same way for other
per-request failures (a row the sampler could draw no token from).
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass

from sonar.core.blocks import BlockManager
from sonar.core.outputs import (
    PLACEHOLDER_TOKEN,
    KVLoadSpec,
    RequestError,
    RequestTiming,
    RequestUpdate,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
)
from sonar.core.policy import POLICIES, make_waiting_queue, policy_key
from sonar.core.quarantine import Quarantine
from sonar.core.request import (
    DuplicateRequestError,
    PromptTooLongError,
    Request,
    RequestStatus,
)
from sonar.core.speculative import Proposer, SpecDecodeStats, SpeculativeConfig, make_proposer

__all__ = ["Recovery", "Scheduler", "SchedulerConfig"]


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
    pipeline_stages: int = 1
    """With more than one, steps are micro-batches for pipeline stages that run several at once:
    steps in flight share no decoding request (one with a token in flight is not scheduled again
    until that token is back: only the last stage knows it; a prefill continues in the next step
    as usual), and a step takes at most its share, ``1 / pipeline_stages``, of the requests
    running and waiting, so that the next step has requests of its own."""
    speculative: SpeculativeConfig | None = None
    """Speculative decoding (`sonar.core.speculative`): a decoding request without a token in
    flight gets up to ``num_speculative_tokens`` drafts after its last token (from the core's
    proposer, or those the worker's draft proposed with its last step), within the step's token
    budget and its ``max_tokens`` and ``max_model_len``; a request whose drafts are in flight is
    not scheduled again until they are back."""
    worker_drafts: bool = False
    """Speculation with async scheduling: the worker makes the drafts, from the tokens it has
    sampled, when it runs the step (a draft model or head: after the step before, with
    ``lookahead`` KV slots past each sampling step as without async scheduling). A decoding request is scheduled while its
    step in flight (drafts and all) is out, with ``k`` draft slots of `PLACEHOLDER_TOKEN` after its
    last token, at positions that assume every draft in flight is kept; the runner moves the
    step's positions back by the drafts that were not, and uses as many of the slots as its
    proposer fills. ``update_from_output`` gives back what the step did not use
    (`Request.draft_slots`)."""
    decode_steps: int = 1
    """Multi-step decode: the most decode steps one step runs back to back on the worker, each
    feeding the token the one before sampled, so that the trip through the scheduler and the
    messages around it are paid once for that many tokens. A step is multi-step only when it is
    made of plain decodes (no prefill, grammar or token in flight) and nothing waits to be
    admitted or loaded; it then decodes, for every request, as many tokens as the request with the
    least room takes (``max_tokens``, ``max_model_len``, LongRoPE's switch), with the KV slots of
    every one (else one step, never a preemption). The worker may cut it short (a request arrived):
    ``update_from_output`` takes back the positions of the tokens that did not come. Not with
    speculative decoding or pipeline stages, and only in the synchronous loop: the shell schedules
    nothing while such a step is out."""
    max_loras: int = 0
    """LoRA: the most distinct adapters among the running requests (the worker's slots); a waiting
    request of another adapter waits while that many run, and those behind it may go first. 0:
    no adapters."""
    whole_media: bool = False
    """A chunk of a prefill never ends inside a request's media span (Gemma 3: an image's tokens
    attend to each other, so they are computed in one step): it ends before the span instead, or,
    when it starts inside or at the span, after it (past ``long_prefill_token_threshold`` if need
    be); a chunk that does not fit the step's budget waits for a later step. A span longer than
    ``max_num_batched_tokens`` would never fit: the caller refuses such requests. Spans that
    touch count as one (`media_runs`)."""
    longrope_switch: int | None = None
    """LongRoPE (Phi-3, Phi-4): the original context. A sequence longer than this is computed with
    the long factors (`Request.long_rope`), as transformers computes it: a longer prompt from its
    first chunk on, and a generation that crosses it is preempted and recomputed whole (transformers
    drops its cache there and prefills again; `sonar.models.rotary`). Drafts stop short of it."""

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_batched_tokens", "max_num_seqs", "decode_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be 0 (no cap) or positive, got {self.long_prefill_token_threshold}"
            )
        if self.scheduling_policy not in POLICIES:
            raise ValueError(
                f"unknown scheduling policy {self.scheduling_policy!r}; choose one of {', '.join(POLICIES)}"
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
        if self.worker_drafts and (self.speculative is None or self.pipeline_stages > 1):
            raise ValueError("worker_drafts needs speculation and one pipeline stage")
        if self.decode_steps > 1 and (self.speculative is not None or self.pipeline_stages > 1):
            raise ValueError("decode_steps above 1 runs without speculative decoding, on one pipeline stage")
        switch = self.longrope_switch
        if switch is not None and (isinstance(switch, bool) or not isinstance(switch, int) or switch <= 0):
            raise ValueError(f"longrope_switch must be a positive integer or None, got {switch!r}")


@dataclass(frozen=True, slots=True)
class Recovery:
    """What ``reset_after_worker_failure`` did."""

    recomputed: list[str]
    """Running requests sent back to the waiting queue, to be computed again."""
    quarantined: list[RequestUpdate]
    """Requests failed alone (``finish_reason`` ``error``), one update each."""


MAX_SPEC_SKIP = 16
"""Most decode steps a request runs without drafts after its drafts missed again and again."""

_RUNNING = RequestStatus.RUNNING
_LOADING = RequestStatus.WAITING_FOR_KV
_PREEMPTED = RequestStatus.PREEMPTED

LowerTierLookup = Callable[[Request], int]
"""How many leading blocks of a request's prefix the offload tiers hold (whole chunks)."""


class Scheduler:
    """Owns every unfinished request, the waiting queue, the running list and the KV blocks."""

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        *,
        lower_tier_lookup: LowerTierLookup | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock`: the time of the requests' `arrival_time`, for their first scheduling and first
        token (`RequestTiming`)."""
        needed = block_manager.blocks_for(config.max_model_len)
        if needed > block_manager.num_blocks:
            raise ValueError(
                f"max_model_len {config.max_model_len} needs {needed} KV blocks of "
                f"{block_manager.block_size} tokens but the cache has {block_manager.num_blocks}; "
                "lower max_model_len or give the KV cache more memory"
            )
        self.config = config
        self.block_manager = block_manager
        self.clock = clock
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
        self.lower_tier_lookup = lower_tier_lookup
        self.loading: dict[str, Request] = {}
        """Requests waiting for their prefix to be loaded (``WAITING_FOR_KV``), aborted ones included
        until their load ends (their blocks must not be reused while the runner writes them)."""
        self._kv_loads: list[KVLoadSpec] = []
        self._load_ids = itertools.count(1)
        self._load_of: dict[str, int] = {}
        """Request id -> the id of the load it waits for."""
        self._fresh: set[str] = set()
        """Requests moved to the running list by a finished load: their next step is their first."""
        self.offload_hits = 0
        self.quarantine = Quarantine()
        """Requests that were in a failed step and have not sampled since (see the module doc)."""
        spec = config.speculative
        # with worker drafts the worker's runner holds the proposer (`sonar.engine.runner`)
        self.proposer: Proposer | None = None if spec is None or config.worker_drafts else make_proposer(spec)
        self.spec_stats = SpecDecodeStats()

    # Requests in and out.

    def add_request(self, request: Request) -> None:
        """Queue ``request``; raise ``PromptTooLongError`` / ``DuplicateRequestError`` first."""
        if request.num_tokens > self.config.max_model_len:
            raise PromptTooLongError(request.request_id, request.num_tokens, self.config.max_model_len)
        if request.request_id in self.requests:
            raise DuplicateRequestError(request.request_id)
        request.seq = next(self._arrivals)
        request.status = RequestStatus.WAITING
        self._take_long_rope(request)
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
        """Finish requests from outside (abort, say).

        Their blocks are freed at once and their ids reach the runner with the next step.
        Unknown or already finished ids are ignored; the found ones are returned.
        """
        return self._finish(((request_id, stop_reason) for request_id in request_ids), status)

    def finish_stopped(self, hits: Mapping[str, int | str | None]) -> list[str]:
        """Finish requests that hit a stop string (found downstream, by the detokenizer), each
        with its own stop reason; as `finish_requests` otherwise."""
        return self._finish(hits.items(), RequestStatus.FINISHED_STOPPED)

    def fail_requests(self, errors: Mapping[str, RequestError], uncache: Set[str] = frozenset()) -> list[RequestUpdate]:
        """End requests with ``FINISHED_ERROR`` and the given error, wherever they are (their
        blocks are freed, the runner drops them with the next step); one update each. Unknown
        or already finished ids are ignored. The blocks of those in `uncache` also leave the
        prefix cache (those no other request holds): their KV may not be what their hashes say."""
        found = [request for request_id in errors if (request := self.requests.get(request_id)) is not None]
        self._finish(((request.request_id, None) for request in found), RequestStatus.FINISHED_ERROR, uncache)
        updates = []
        for request in found:
            request.error = errors[request.request_id]
            updates.append(self._update(request, []))
        return updates

    def _finish(
        self, items: Iterable[tuple[str, int | str | None]], status: RequestStatus, uncache: Set[str] = frozenset()
    ) -> list[str]:
        """Finish each ``(request id, stop reason)`` found; the running list is rebuilt once for
        the lot, so finishing k of n running requests costs O(n + k), not O(n * k)."""
        if not status.is_finished:
            raise ValueError(f"{status.name} is not a finished status")
        found = []
        finished_running = False
        for request_id, stop_reason in items:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == _RUNNING:
                if request_id in uncache:
                    self.block_manager.free(request_id, num_computed_tokens=0, request=request)
                else:
                    self.block_manager.free(request_id, request=request)
                finished_running = True
            elif request.status == _LOADING:
                pass  # its blocks are freed when its load ends (the runner may be writing them)
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
        if self.proposer is not None:
            if request.output_token_ids:  # the proposer learns the last tokens (suffix keeps outputs)
                self.proposer.propose(request.request_id, request.prompt_token_ids, request.output_token_ids, 0)
            self.proposer.finish(request.request_id)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)
        self.quarantine.discard(request.request_id)

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

        stages = config.pipeline_stages
        # a micro-batch's share of the requests (no cap without pipeline stages)
        cap = -(-(len(running) + len(self.waiting)) // stages) if stages > 1 else len(running) + len(self.waiting)
        spec = config.speculative
        worker_drafts = config.worker_drafts
        speculating = spec is not None and (
            spec.disable_by_batch_size is None or len(running) < spec.disable_by_batch_size
        )
        for decodes in (True, False):
            i = 0
            while i < len(running) and budget > 0 and len(scheduled) < cap:
                request = running[i]
                remaining = len(request.all_token_ids) + request.num_placeholders - request.num_computed_tokens
                if (
                    remaining <= 0
                    or (remaining == 1) != decodes
                    or request.request_id in scheduled
                    or (
                        request.num_placeholders
                        and (stages > 1 or request.spec_token_ids or self._ends_in_flight(request))
                    )
                ):
                    i += 1
                    continue
                if self._crosses_switch(request):
                    # LongRoPE: past the original context the whole sequence takes the long
                    # factors; its KV holds short-factor keys, so it is recomputed from the start
                    running.pop(i)
                    self._preempt(request)
                    preempted.append(request.request_id)
                    continue
                if decodes and speculating and worker_drafts:
                    slots = self._draft_slots(request, budget - 1)
                    if slots and bm.allocate_slots(request, 1 + slots + self._lookahead(request, 1 + slots)):
                        scheduled[request.request_id] = 1 + slots
                        budget -= 1 + slots
                        i += 1
                        continue
                elif decodes and speculating and not request.num_placeholders:
                    drafts = self._propose(request, budget - 1)
                    if drafts and bm.allocate_slots(
                        request, 1 + len(drafts) + self._lookahead(request, 1 + len(drafts))
                    ):
                        request.spec_token_ids = drafts
                        scheduled[request.request_id] = 1 + len(drafts)
                        budget -= 1 + len(drafts)
                        i += 1
                        continue
                num_new = remaining
                if threshold and num_new > threshold:
                    num_new = threshold
                if num_new > budget:
                    num_new = budget
                if config.whole_media and request.media:
                    num_new = _whole_media(request, request.num_computed_tokens, num_new, min(budget, remaining))
                    if not num_new:
                        i += 1
                        continue
                ahead = self._lookahead(request, num_new) if num_new == remaining else 0
                while not bm.allocate_slots(request, num_new + ahead):
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
            budget = self._admit(budget, threshold, scheduled, admitted, cap)
        steps = self._decode_steps(scheduled) if config.decode_steps > 1 and not preempted and not admitted else 1

        step = []
        total = 0
        for request_id, num_new in scheduled.items():
            request = self.requests[request_id]
            start = request.num_computed_tokens
            end = start + num_new
            known = len(request.all_token_ids)
            token_ids = request.all_token_ids[start:end]
            drafts = request.spec_token_ids
            num_drafts = len(drafts)
            if drafts:
                token_ids += drafts
            elif end > known:  # tokens the steps in flight sample (and worker drafts' slots)
                token_ids += [PLACEHOLDER_TOKEN] * (end - max(start, known))
                if worker_drafts:
                    num_drafts = max(0, end - (known + request.num_placeholders))
            sample = end - num_drafts == known + request.num_placeholders
            step.append(
                ScheduledRequest(
                    request_id,
                    token_ids,
                    start,
                    bm.block_ids(request_id).copy(),
                    sample,
                    request_id in admitted or request_id in self._fresh,
                    request.num_prompt_tokens,
                    num_drafts,
                    long_rope=request.long_rope,
                )
            )
            request.num_computed_tokens = end + steps - 1
            if sample:
                request.num_placeholders += steps + (num_drafts if worker_drafts else 0)
                if worker_drafts:
                    request.draft_slots.append(num_drafts)
                if steps > 1:
                    request.decode_steps = steps
            total += num_new + steps - 1
        if self._fresh:
            self._fresh.difference_update(scheduled)
        finished, self._finished_ids = self._finished_ids, []
        loads, self._kv_loads = self._kv_loads, []
        return SchedulerOutput(
            next(self._step_ids), step, total, preempted, finished, bm.take_kv_stores(), loads, decode_steps=steps
        )

    def _decode_steps(self, scheduled: dict[str, int]) -> int:
        """Multi-step decode: how many decode steps the step of ``scheduled`` (one token each so far)
        runs back to back (`SchedulerConfig.decode_steps`), with every step's KV slots allocated;
        1 where it cannot be more. Slots allocated for a number that then failed for another
        request stay with theirs, for their next decodes."""
        if self.waiting or self.loading or self._kv_loads or not scheduled:
            return 1
        config = self.config
        steps = config.decode_steps
        requests = []
        for request_id, num_new in scheduled.items():
            request = self.requests[request_id]
            if (
                num_new != 1
                or request.num_tokens - request.num_computed_tokens != 1
                or request.num_placeholders
                or request.grammar is not None
                or request_id in self._fresh
            ):
                return 1
            # its step j computes position num_tokens - 1 + j, as a lone decode of a sequence of
            # num_tokens + j tokens would: within max_model_len and short of LongRoPE's switch
            room = min(config.max_model_len - request.num_tokens, self._before_switch(request, request.num_tokens) + 1)
            if request.max_tokens is not None:
                room = min(room, request.max_tokens - request.num_output_tokens)
            steps = min(steps, room)
            requests.append(request)
        if steps <= 1:
            return 1
        for request in requests:
            if not self.block_manager.allocate_slots(request, steps):
                return 1
        return steps

    def _lookahead(self, request: Request, num_new: int) -> int:
        """KV slots past a sampling step's ``num_new`` tokens that a draft model writes
        (`SpeculativeConfig.lookahead`), within ``max_model_len``."""
        spec = self.config.speculative
        if spec is None or not spec.lookahead:
            return 0
        return max(0, min(spec.lookahead, self.config.max_model_len - request.num_computed_tokens - num_new))

    def _propose(self, request: Request, room: int) -> list[int]:
        """Drafts for a decoding request: at most ``room`` (the step's budget after its own
        token), and none that its step could not keep (past ``max_tokens`` or ``max_model_len``,
        counting the token sampled after the last draft)."""
        assert self.config.speculative is not None
        limit = min(
            self.config.speculative.num_speculative_tokens,
            room,
            self.config.max_model_len - request.num_tokens - 1,
            self._before_switch(request, request.num_tokens),
        )
        if request.max_tokens is not None:
            limit = min(limit, request.max_tokens - request.num_output_tokens - 1)
        proposed, request.proposed = request.proposed, []  # a draft model's, from the request's last step
        if request.spec_skip:
            request.spec_skip -= 1
            return []
        if limit <= 0:
            return []
        if self.proposer is None:
            drafts = proposed[:limit]
        else:
            drafts = self.proposer.propose(
                request.request_id, request.prompt_token_ids, request.output_token_ids, limit
            )[:limit]
        if drafts and request.grammar is not None:  # only what the grammar allows
            drafts = drafts[: request.grammar.valid_prefix(drafts)]
        return drafts

    def _draft_slots(self, request: Request, room: int) -> int:
        """Worker drafts: how many draft slots a decode of ``request`` gets, at most ``room``, and
        none its step could not keep even if every draft in flight is kept (counting the token
        sampled after the last draft). 0 while it backs off, and under a grammar (the shell
        fills a grammar's bitmask rows from drafts it knows)."""
        assert self.config.speculative is not None
        if request.spec_skip:
            request.spec_skip -= 1
            return 0
        if request.grammar is not None:
            return 0
        ahead = request.num_tokens + request.num_placeholders
        limit = min(
            self.config.speculative.num_speculative_tokens,
            room,
            self.config.max_model_len - ahead - 1,
            self._before_switch(request, ahead),
        )
        if request.max_tokens is not None:
            limit = min(limit, request.max_tokens - request.num_output_tokens - request.num_placeholders - 1)
        return max(limit, 0)

    def _take_long_rope(self, request: Request) -> None:
        """LongRoPE: a request with nothing computed whose sequence is longer than the original
        context takes the long factors, and its blocks the keys that say so."""
        switch = self.config.longrope_switch
        if switch is not None and not request.long_rope and request.num_tokens > switch:
            request.long_rope = True
            request.block_hashes = []
            self.block_manager.update_hashes(request)

    def _crosses_switch(self, request: Request) -> bool:
        """LongRoPE: whether a request computed with the short factors would pass the original
        context with its next token (or with the tokens in flight: with worker drafts those count
        every draft kept, and a request resumed shorter keeps the short factors)."""
        switch = self.config.longrope_switch
        return switch is not None and not request.long_rope and request.num_tokens + request.num_placeholders > switch

    def _before_switch(self, request: Request, ahead: int) -> int:
        """LongRoPE: how many drafts after ``ahead`` tokens a short-factor request may verify
        without passing the original context (a token past it is computed after a recompute)."""
        switch = self.config.longrope_switch
        return self.config.max_model_len if switch is None or request.long_rope else switch - ahead

    def _ends_in_flight(self, request: Request) -> bool:
        """The tokens the steps in flight sample for ``request`` are sure to finish it. With worker
        drafts a step in flight is sure of one token only, but its positions assume all of them
        (``max_model_len`` bounds those)."""
        ahead = request.num_tokens + request.num_placeholders
        sure = len(request.draft_slots) if self.config.worker_drafts else request.num_placeholders
        return ahead >= self.config.max_model_len or (
            request.max_tokens is not None and request.num_output_tokens + sure >= request.max_tokens
        )

    def _admit(self, budget: int, threshold: int, scheduled: dict[str, int], admitted: set[str], cap: int) -> int:
        config = self.config
        waiting = self.waiting
        quarantine = self.quarantine
        isolating = bool(quarantine)
        suspect_in, unproven_in, any_suspect, proven_first = self._isolation()
        adapters = self._adapters() if config.max_loras else set()
        skipped: list[Request] = []
        try:
            while (
                len(waiting)
                and budget > 0
                and len(self.running) + len(self.loading) < config.max_num_seqs
                and len(scheduled) < cap
            ):
                request = waiting.peek()
                if request.num_placeholders:
                    break  # preempted while a step in flight samples for it: resumed once that is back
                suspect = isolating and request.request_id in quarantine
                unproven = isolating and not suspect and not request.output_token_ids
                if suspect:
                    blocked = (
                        suspect_in
                        or unproven_in
                        or (proven_first and not request.output_token_ids)
                        or not (any_suspect or quarantine.ready(request.request_id))
                    )
                else:
                    blocked = unproven and suspect_in
                lora = request.lora_key if config.max_loras else None
                if lora is not None and lora not in adapters and len(adapters) >= config.max_loras:
                    blocked = True  # no slot for its adapter until a request of another finishes
                if blocked:
                    skipped.append(waiting.pop())
                    continue
                left = self._admit_first(request, budget, threshold, scheduled, admitted)
                if left is None:
                    break
                if lora is not None:
                    adapters.add(lora)
                budget = left
                suspect_in = suspect_in or suspect
                unproven_in = unproven_in or unproven
        finally:
            for request in reversed(skipped):  # back to the front, in their order
                waiting.add_preempted(request)
        return budget

    def _adapters(self) -> set[str]:
        """The LoRA adapters of the requests that run or load (each holds a worker slot)."""
        return {
            key
            for request in (*self.running, *self.loading.values())
            if (key := request.lora_key) is not None and request.status in (_RUNNING, _LOADING)
        }

    def _isolation(self) -> tuple[bool, bool, bool, bool]:
        """For ``_admit`` while there are suspects: (a suspect runs or loads, an unproven request
        runs or loads, any suspect may run even without a witness, proven suspects go first).

        A suspect shares its steps only with requests that have sampled before, whose inputs have
        passed: a request that has not (*unproven*: new, its prompt never computed through) could
        make the step fail itself, and the suspect would take the blame. The third holds when
        every request is a suspect and none of those waiting is ready: no step without them can
        come to tell them apart, so they run (one at a time) as they are. The fourth holds while a
        ready suspect that had sampled before waits: those run before unproven suspects, the
        likelier culprits of a crash (a poison prompt crashes the step that first computes it),
        so that their passing steps witness for the unproven ones, convicted at their first run
        alone.
        """
        quarantine = self.quarantine
        if not quarantine:
            return False, False, False, False
        requests = self.requests
        busy = (_RUNNING, _LOADING)
        suspect_in = any(requests[rid].status in busy for rid in quarantine.suspects)
        unproven_in = any(
            not r.output_token_ids and r.request_id not in quarantine
            for r in (*self.running, *self.loading.values())
            if r.status in busy
        )
        waiting = [
            (requests[rid], suspect) for rid, suspect in quarantine.suspects.items() if requests[rid].status not in busy
        ]
        any_suspect = len(quarantine) == len(requests) and not any(suspect.ready for _, suspect in waiting)
        proven_first = any(suspect.ready and request.output_token_ids for request, suspect in waiting)
        return suspect_in, unproven_in, any_suspect, proven_first

    def _admit_first(
        self, request: Request, budget: int, threshold: int, scheduled: dict[str, int], admitted: set[str]
    ) -> int | None:
        """Admit ``request``, the first of the waiting queue, if it fits: the budget left, or
        None when it does not fit now (admission stops there)."""
        config = self.config
        bm = self.block_manager
        reserve_full = config.scheduler_reserve_full_isl
        lookup = self.lower_tier_lookup
        self._take_long_rope(request)  # a prompt past the original context, or a crossing's recompute
        if request.skip_reading_prefix_cache:
            hits, num_hit_tokens = [], 0
        else:
            hits, num_hit_tokens = bm.get_computed_blocks(request)
            if lookup is not None:
                admitted_to_load = self._admit_for_load(request, hits, lookup, reserve_full)
                if admitted_to_load is None:
                    return None  # no room for its blocks now
                if admitted_to_load:
                    return budget
        num_new = request.num_tokens - num_hit_tokens
        if config.enable_chunked_prefill:
            if threshold and num_new > threshold:
                num_new = threshold
            if num_new > budget:
                num_new = budget
            if config.whole_media and request.media:
                num_new = _whole_media(
                    request, num_hit_tokens, num_new, min(budget, request.num_tokens - num_hit_tokens)
                )
                if not num_new:
                    return None
        elif num_new > budget:
            return None
        completes = num_hit_tokens + num_new == request.num_tokens  # it samples: room for a draft's KV
        ahead = self._lookahead(request, num_hit_tokens + num_new) if completes else 0
        # The watermark is waived while nothing runs, so a request that needs nearly the
        # whole cache is still admitted once it is alone.
        if not bm.allocate_slots(
            request,
            num_new + ahead,
            new_computed_blocks=hits,
            reserve_tokens=request.num_tokens if reserve_full else 0,
            keep_free_blocks=self._watermark_blocks if self.running else 0,
        ):
            return None
        self.waiting.pop()
        request.status = _RUNNING
        if request.scheduled_time is None:
            request.scheduled_time = self.clock()
        request.num_computed_tokens = num_hit_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens
        bisect.insort(self.running, request, key=self._key)
        scheduled[request.request_id] = num_new
        admitted.add(request.request_id)
        return budget - num_new

    def _admit_for_load(self, request: Request, hits: list, lookup: LowerTierLookup, reserve_full: bool) -> bool | None:
        """Park ``request`` as ``WAITING_FOR_KV`` if the tiers extend its prefix-cache hits.

        True: admitted to load; False: nothing to load (admit it the usual way); None: it would
        load but its blocks do not fit now (it stays first in the queue).
        """
        bm = self.block_manager
        limit = min((request.num_tokens - 1) // bm.block_size, len(request.block_hashes))
        num_lower = min(lookup(request), limit)
        num_load = num_lower - len(hits)
        if num_load <= 0:
            return False
        block_ids = bm.allocate_for_load(
            request,
            hits,
            num_load,
            reserve_tokens=request.num_tokens if reserve_full else 0,
            keep_free_blocks=self._watermark_blocks if self.running else 0,
        )
        if block_ids is None:
            return None
        self.waiting.pop()
        request.status = _LOADING
        request.num_computed_tokens = len(hits) * bm.block_size
        self.loading[request.request_id] = request
        load_id = self._load_of[request.request_id] = next(self._load_ids)
        self._kv_loads.append(
            KVLoadSpec(request.request_id, request.block_hashes[:num_lower], len(hits), list(block_ids), load_id)
        )
        return True

    def finish_kv_load(self, request_id: str, num_loaded_blocks: int, load_id: int | None = None) -> bool:
        """The runner loaded the first ``num_loaded_blocks`` blocks of a ``kv_loads`` entry.

        The loaded blocks enter the prefix cache, count as computed and cached tokens, and the
        request moves to the running list (its next step computes the rest, including blocks
        that could not be loaded). An aborted request's blocks are freed now. Returns False for
        an unknown request, or for another ``load_id`` than the one of its current load (a late
        report of a load abandoned by a reset).
        """
        if request_id not in self.loading or (load_id is not None and self._load_of.get(request_id) != load_id):
            return False
        request = self.loading.pop(request_id)
        del self._load_of[request_id]
        bm = self.block_manager
        if request.status != _LOADING:  # finished (aborted) while loading
            bm.free(request_id)
            return True
        loaded_tokens = max(0, num_loaded_blocks) * bm.block_size
        limit = (request.num_tokens - 1) // bm.block_size * bm.block_size
        computed = min(request.num_computed_tokens + loaded_tokens, limit)
        loaded_tokens = computed - request.num_computed_tokens
        bm.cache_loaded(request, computed)
        request.num_computed_tokens = computed
        self.offload_hits += loaded_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = computed
            request.num_offloaded_tokens = loaded_tokens
        request.status = _RUNNING
        if request.scheduled_time is None:
            request.scheduled_time = self.clock()
        bisect.insort(self.running, request, key=self._key)
        self._fresh.add(request_id)
        return True

    def _preempt(self, request: Request) -> None:
        """Send a running request (already off the running list) back to the waiting queue."""
        self._fresh.discard(request.request_id)
        request.spec_token_ids = []
        request.proposed = []
        self.block_manager.free(request.request_id, num_computed_tokens=request.num_computed_tokens, request=request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_preempted(request)

    # Results of a step.

    def update_from_output(
        self,
        sampled: Mapping[str, Sequence[int]],
        proposed: Mapping[str, list[int]] | None = None,
        drafted: Mapping[str, int] | None = None,
        partial: bool = False,
    ) -> list[RequestUpdate]:
        """Apply a step's results: append sampled tokens, finish what ended, free its blocks.

        ``sampled`` maps request id to the tokens sampled for it this step (usually one).
        A request finishes on a token in its ``stop_token_ids`` (once ``min_tokens`` are
        out), when its grammar (structured outputs) terminates, on reaching ``max_tokens``, or on
        reaching ``max_model_len``; a token its grammar refuses fails it (``FINISHED_ERROR``); later tokens
        of the same step are dropped (a stop string, found downstream, ends a request through
        `finish_requests`). Ids no longer running (aborted or
        finished meanwhile) are ignored, except a request preempted while this step was in
        flight, which keeps the token it computed. Returns one update per request that got
        tokens or ended. ``proposed``: a draft model's drafts for the next step of requests of this
        one (`SchedulerConfig.speculative`). ``drafted``: with worker drafts, how many drafts the
        runner made for each request of this step. ``partial``: tokens of a multi-step decode still
        running (`SchedulerOutput.decode_steps`), streamed ahead of its result, which then brings
        only the rest (the slots and positions of its later decode steps stay counted until then).
        """
        max_model_len = self.config.max_model_len
        bm = self.block_manager
        updates: list[RequestUpdate] = []
        any_finished = False
        for request_id, token_ids in sampled.items():
            request = self.requests.get(request_id)
            if request is None or not token_ids:
                continue
            in_flight = request.num_placeholders > 0
            steps = request.decode_steps
            if request.draft_slots:
                self._give_back_slots(request, len(token_ids), (drafted or {}).get(request_id, 0))
            elif steps:
                done = len(token_ids) if partial else steps
                request.decode_steps -= done
                request.num_placeholders -= done
            elif in_flight:
                request.num_placeholders -= 1
            drafts = request.spec_token_ids
            if drafts:
                request.spec_token_ids = []
                accepted = 0
                while accepted < min(len(drafts), len(token_ids)) and token_ids[accepted] == drafts[accepted]:
                    accepted += 1
                self.spec_stats.record(len(drafts), accepted, self.config.speculative.num_speculative_tokens)
                if accepted:
                    request.spec_misses = 0
                else:  # a request whose guesses miss proposes less often: 1, 2, 4 .. 16 steps without
                    request.spec_misses += 1
                    request.spec_skip = min(1 << (request.spec_misses - 1), MAX_SPEC_SKIP)
                if request.status == _RUNNING:
                    # the KV of the rejected drafts is overwritten by the tokens that follow; the
                    # last token kept has no KV yet, as after any decode
                    request.num_computed_tokens = min(
                        request.num_computed_tokens, len(request.all_token_ids) + len(token_ids) - 1
                    )
            status = request.status
            if status != _RUNNING and not (status == _PREEMPTED and in_flight):
                continue
            output = request.output_token_ids
            all_ids = request.all_token_ids
            grammar = request.grammar
            first = len(output)
            for token in token_ids:
                output.append(token)
                all_ids.append(token)
                if grammar is not None and not grammar.accept_token(token):
                    request.status = RequestStatus.FINISHED_ERROR
                    request.error = RequestError(
                        "grammar",
                        f"request {request_id!r}: token {token} does not follow its structured output grammar",
                    )
                    break
                if token in request.stop_token_ids and len(output) >= request.min_tokens:
                    request.status = RequestStatus.FINISHED_STOPPED
                    request.stop_reason = token
                    break
                if grammar is not None and grammar.is_terminated():
                    request.status = RequestStatus.FINISHED_STOPPED
                    break
                if len(all_ids) >= max_model_len or (
                    request.max_tokens is not None and len(output) >= request.max_tokens
                ):
                    request.status = RequestStatus.FINISHED_LENGTH
                    break
            if steps and not partial and request.num_computed_tokens >= len(all_ids):
                # a multi-step decode cut short, or past its request's end: the positions of the
                # tokens it did not keep are recomputed (their slots stay the request's)
                request.num_computed_tokens = len(all_ids) - 1
            if request.status == status:
                bm.update_hashes(request)
                if proposed and status == _RUNNING:
                    request.proposed = proposed.get(request_id, [])
            elif status == _PREEMPTED:  # ended by the token it computed before it was preempted
                self.waiting.remove(request)
                self._retire(request)
            else:
                bm.free(request_id, request=request)
                self._retire(request)
                any_finished = True
            update = self._update(request, output[first:])
            if first == 0 and output and request.scheduled_time is not None:
                scheduled = request.scheduled_time
                update.timing = RequestTiming(scheduled - request.arrival_time, self.clock() - scheduled)
            updates.append(update)
        if any_finished:
            self.running = [r for r in self.running if r.status == _RUNNING]
        if self.quarantine and sampled:
            busy = (_RUNNING, _LOADING)
            self.quarantine.passed(
                sampled, [rid for rid in self.quarantine.suspects if self.requests[rid].status not in busy]
            )
        return updates

    def _give_back_slots(self, request: Request, kept: int, drafted: int) -> None:
        """Worker drafts: a step of ``request`` came back with ``kept`` tokens from ``drafted``
        drafts; the placeholders and positions it counted for the slots it did not fill or keep go
        back (its later steps in flight were placed past them: the runner moved them back)."""
        slots = request.draft_slots.pop(0)
        request.num_placeholders -= 1 + slots
        if drafted:
            accepted = max(0, min(drafted, kept - 1))
            self.spec_stats.record(drafted, accepted, self.config.speculative.num_speculative_tokens)
            if accepted:
                request.spec_misses = 0
            else:
                request.spec_misses += 1
                request.spec_skip = min(1 << (request.spec_misses - 1), MAX_SPEC_SKIP)
        if request.status == _RUNNING:
            request.num_computed_tokens -= 1 + slots - kept

    def finish_pooled(self, request_ids: Iterable[str]) -> list[RequestUpdate]:
        """Finish pooling requests whose prompt a step computed through (their result travels
        beside the updates): ``FINISHED_STOPPED``, no tokens, blocks freed. A pooling request is
        admitted with ``max_tokens`` 1, so its last prompt chunk is its one sampling step and it
        is never scheduled again while that step is in flight; one preempted meanwhile is done
        all the same. Ids no longer known are ignored; one update each."""
        updates: list[RequestUpdate] = []
        done: list[str] = []
        any_running = False
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            in_flight = request.num_placeholders > 0
            if in_flight:
                request.num_placeholders -= 1
            if request.status == _RUNNING:
                self.block_manager.free(request_id, request=request)
                any_running = True
            elif request.status == _PREEMPTED and in_flight:
                self.waiting.remove(request)
            else:
                continue
            request.status = RequestStatus.FINISHED_STOPPED
            self._retire(request)
            done.append(request_id)
            updates.append(self._update(request, []))
        if any_running:
            self.running = [r for r in self.running if r.status == _RUNNING]
        if self.quarantine and done:
            busy = (_RUNNING, _LOADING)
            self.quarantine.passed(
                done, [rid for rid in self.quarantine.suspects if self.requests[rid].status not in busy]
            )
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
            request.error,
        )

    def reset_after_worker_failure(self, crashed: Iterable[str] = ()) -> Recovery:
        """Quarantine, then preempt every running request and forget the prefix cache.

        ``crashed``: the requests of the step that failed (none when the step never reached the
        worker, or failed for a reason of the worker's own). Those it convicts are failed alone
        (see `sonar.core.quarantine`); the others of the step become suspects. After a worker
        crash the KV of the steps in flight is lost; the running requests are recomputed from
        their tokens, in their original order.
        """
        step = [rid for rid in dict.fromkeys(crashed) if rid in self.requests]
        convicted = self.quarantine.crashed(step, self.requests.keys())
        quarantined = self.fail_requests(
            {
                rid: RequestError(
                    "quarantined",
                    f"request {rid!r} was in flight in {crashes} worker crashes, the last "
                    "while it was the only suspect in its step; it was failed alone so "
                    "the other requests could go on",
                )
                for rid, crashes in convicted.items()
            }
        )
        ids = []
        while self.running:
            request = self.running.pop()
            self._preempt(request)
            ids.append(request.request_id)
        for request in self.requests.values():  # the steps in flight died too
            request.num_placeholders = 0
            request.draft_slots = []
            request.decode_steps = 0
        # Loads in flight died with the worker: recompute those requests too.
        self._load_of.clear()
        for request_id, request in list(self.loading.items()):
            del self.loading[request_id]
            self.block_manager.free(request_id)
            if request.status == _LOADING:
                request.status = RequestStatus.PREEMPTED
                request.num_computed_tokens = 0
                self.waiting.add_preempted(request)
        self._kv_loads.clear()
        # Their blocks' KV is gone with the worker: drop the stores, and offer those chunks again
        # when a request computes them anew.
        dropped = self.block_manager.take_kv_stores()
        self.block_manager.forget_offloaded([spec.block_hashes[-1] for spec in dropped])
        self.block_manager.reset_prefix_cache()
        return Recovery(ids, quarantined)

    # Introspection.

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_pending_kv_transfers(self) -> bool:
        """KV to store or load that the next ``schedule()`` would hand out (the shell must step
        even when no request is left, so freed blocks are offloaded before they are reused)."""
        return bool(self._kv_loads) or self.block_manager.has_kv_stores

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
            offload_hits=self.offload_hits,
            num_loading=sum(1 for r in self.loading.values() if r.status == _LOADING),
            spec_num_drafts=self.spec_stats.num_drafts,
            spec_num_draft_tokens=self.spec_stats.num_draft_tokens,
            spec_num_accepted_tokens=self.spec_stats.num_accepted_tokens,
            spec_accepted_per_position=list(self.spec_stats.accepted_per_position or ()),
            running_loras=sorted({r.lora.name for r in (*self.running, *self.loading.values()) if r.lora is not None}),
            waiting_loras=sorted({r.lora.name for r in self.waiting if r.lora is not None}),
            kv_residency=None if bm.pool.residency is None else bm.pool.residency.stats,
        )

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` unless queues, statuses and block tables agree."""
        bm = self.block_manager
        bm.check_invariants()
        running_ids = [r.request_id for r in self.running]
        waiting_ids = [r.request_id for r in self.waiting]
        if len(self.running) + len(self.loading) > self.config.max_num_seqs:
            raise AssertionError(f"{len(self.running)} running, above max_num_seqs")
        loading_ids = [rid for rid, r in self.loading.items() if r.status == _LOADING]
        if sorted(running_ids + waiting_ids + loading_ids) != sorted(self.requests):
            raise AssertionError("a request is missing from, or duplicated in, the queues")
        keys = [self._key(r) for r in self.running]
        if keys != sorted(keys):  # type: ignore[type-var]
            raise AssertionError("the running list is out of policy order")
        if sorted(bm.request_ids()) != sorted(running_ids + list(self.loading)):
            raise AssertionError("block tables do not belong to exactly the running and loading requests")
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
            if request.num_computed_tokens > request.num_tokens + request.num_placeholders + len(
                request.spec_token_ids
            ):
                raise AssertionError(f"{request!r} computed more tokens than it has")
        suspects = list(self.quarantine.suspects)
        if not set(suspects) <= set(self.requests):
            raise AssertionError("a finished request is still a suspect")
        in_flight = [rid for rid in suspects if self.requests[rid].status in (_RUNNING, _LOADING)]
        if len(in_flight) > 1:
            raise AssertionError(f"suspects {in_flight} run together")


def media_runs(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Prompt ranges ``[first, end)`` of media spans ``(offset, length)`` (in prompt order), spans
    that touch merged into one: their tokens are one run of image tokens, which attend to each
    other as one block where media are kept whole."""
    runs: list[tuple[int, int]] = []
    for offset, length in spans:
        if runs and runs[-1][1] == offset:
            runs[-1] = (runs[-1][0], offset + length)
        else:
            runs.append((offset, offset + length))
    return runs


def _whole_media(request: Request, start: int, num_new: int, limit: int) -> int:
    """`num_new` tokens from `start`, changed so that they do not end inside a run of media spans
    of `request` (`SchedulerConfig.whole_media`): to end before the run, or after it where the
    chunk starts inside it or at its first token; 0 when that is more than `limit`."""
    end = start + num_new
    for first, last in media_runs((offset, length) for offset, length, _ in request.media):
        if first < end < last:
            end = first if first > start else last
            break
    return end - start if end - start <= limit else 0
