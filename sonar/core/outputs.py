"""What one scheduling step hands to the model runner, and what the scheduler reports back.

These are msgspec Structs of strings, ints and lists so the same values can cross a
process boundary (msgpack) unchanged.
"""

from __future__ import annotations

import msgspec

from sonar.core.flops import MFUStats
from sonar.core.kv_residency import KVResidencyStats

__all__ = [
    "PLACEHOLDER_TOKEN",
    "KVLoadSpec",
    "KVStoreSpec",
    "RequestError",
    "RequestModelTime",
    "RequestTiming",
    "RequestUpdate",
    "ScheduledRequest",
    "SchedulerOutput",
    "SchedulerStats",
]


PLACEHOLDER_TOKEN = -1
"""In `ScheduledRequest.token_ids`: the token a step still in flight samples at this position
(async scheduling); the runner, which sampled it, puts it in."""


class ScheduledRequest(msgspec.Struct, array_like=True, gc=False):
    """One request's share of a step.

    The runner computes ``token_ids`` at positions ``start_pos .. start_pos + len - 1``,
    writing their KV into the slots those positions map to through ``block_ids`` (position
    ``p`` lives in block ``block_ids[p // block_size]`` at offset ``p % block_size``) and
    attending over positions ``0 .. start_pos + len - 1``. When ``sample`` is true the step
    reaches the last known token of the request and the runner samples the next token from
    the logits of the last position; otherwise this is a chunk of a longer prefill.
    A ``token_ids`` entry `PLACEHOLDER_TOKEN` is a token sampled by an earlier step whose result
    the scheduler did not have yet when it scheduled this one.
    """

    req_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    sample: bool
    is_new: bool
    """First step since admission or since resuming after preemption: the runner must
    (re)build its per-request state (sampling parameters, output history)."""
    num_prompt_tokens: int
    """Tokens of the original prompt; positions past it are earlier outputs (after a
    preemption they are recomputed with the prompt)."""
    num_drafts: int = 0
    """Speculative decoding: the last ``num_drafts`` of ``token_ids`` are guesses, not known
    tokens. The runner samples at each of the last ``1 + num_drafts`` positions and returns the
    drafts its samples agree with, up to the first that differs, plus one sampled token."""
    long_rope: bool = False
    """LongRoPE: the request's sequence is longer than the original context and computed with the
    long factors (`Request.long_rope`)."""


class KVStoreSpec(msgspec.Struct, array_like=True, gc=False):
    """One chunk to copy out to the offload tiers before this step's forward pass overwrites it.

    ``block_ids`` are primary blocks whose KV is complete now (their request finished, was
    aborted or preempted); the runner gathers them at the start of the step, before any KV of
    the step is written, since the scheduler may already have handed them to other requests.
    """

    block_hashes: list[bytes]
    parent_hash: bytes | None
    token_ids: list[int]
    block_ids: list[int]
    extra_keys: list[list[object] | None] | None = None


class KVLoadSpec(msgspec.Struct, array_like=True, gc=False):
    """Bring blocks ``start_block ..`` of a request's prefix back from the offload tiers.

    ``block_hashes`` are the request's hashes from block 0 up to the last block to load;
    ``block_ids[i]`` receives block ``start_block + i``. The request waits (status
    ``WAITING_FOR_KV``) until the runner reports how many blocks it loaded
    (``Scheduler.finish_kv_load``); blocks that could not be loaded are recomputed.
    """

    req_id: str
    block_hashes: list[bytes]
    start_block: int
    block_ids: list[int]
    load_id: int = 0
    """Echoed back in ``finish_kv_load`` so a late report of an abandoned load is ignored."""


class SchedulerOutput(msgspec.Struct, gc=False):
    """One step of work: everything a runner needs to build a flat batch.

    ``requests`` lists running requests first (decodes, then continuing prefills), then
    requests admitted this step. The runner must write the KV of every token of the step
    before any attention of the step reads the cache: a request admitted this step may
    reuse a prefix block that another request of the same step is filling.
    """

    step_id: int
    requests: list[ScheduledRequest]
    num_scheduled_tokens: int
    preempted_req_ids: list[str]
    """Requests sent back to the waiting queue this step; the runner drops their state."""
    finished_req_ids: list[str]
    """Requests finished or aborted since the previous step; the runner drops their state."""
    kv_stores: list[KVStoreSpec] = []
    """Chunks to offload, gathered before this step's forward pass (empty without offloading)."""
    kv_loads: list[KVLoadSpec] = []
    """Prefix blocks to load from the offload tiers, off the step's critical path."""
    decode_steps: int = 1
    """Multi-step decode (`SchedulerConfig.decode_steps`): every request is a decode, and the runner
    decodes this many tokens for each, back to back, each step feeding the token the one before
    sampled (its KV slots are in ``block_ids``). It may stop early (`CutSteps`); the result then has
    fewer tokens, the same number for every request."""

    @property
    def is_empty(self) -> bool:
        """No request to compute (there may still be KV to store or load)."""
        return not self.requests

    @property
    def has_kv_transfers(self) -> bool:
        return bool(self.kv_stores or self.kv_loads)


class RequestError(msgspec.Struct, frozen=True, gc=False):
    """Why one request failed on its own while the others went on."""

    type: str
    """``sampling``: no token could be sampled for it (its row of logits was all -inf or NaN);
    ``quarantined``: it was in flight in worker crashes (`sonar.core.quarantine`); ``grammar``: a
    sampled token broke its structured output grammar (the bitmask should make that impossible);
    ``lora``: its LoRA adapter could not be loaded (its folder gone or rewritten since it was)."""
    message: str


class RequestTiming(msgspec.Struct, array_like=True, gc=False):
    """A request's way to its first token, measured by the scheduler (one clock, so it holds
    wherever the frontend runs): the per-request metrics start from it."""

    queue_seconds: float
    """From its arrival to its first scheduling."""
    first_token_seconds: float
    """From its first scheduling to its first token."""


class StepRef(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """--collect-detailed-traces: the OpenTelemetry context of one ``scheduler.step`` span, which a
    request's span links to."""

    trace_id: bytes
    """16 bytes, big-endian."""
    span_id: int


class RequestModelTime(msgspec.Struct, array_like=True, gc=False):
    """--collect-detailed-traces: a request's share of the worker so far, summed over the steps it
    was in (each step counts whole for each of its requests, as vLLM counts them)."""

    execute_seconds: float | None
    """The worker's time on those steps (``worker``): inputs, forward pass, sampling; None
    unless asked."""
    forward_seconds: float | None
    """Of which the model's forward pass (``model``; device-synchronized); None unless asked."""
    steps: int = 0
    """The steps the request was in so far (with step spans exported, else 0)."""
    links: list[StepRef] = []
    """The step spans of the steps since the request's previous update, while it has had fewer
    than `MAX_STEP_LINKS` (`sonar.engine.step_spans`): the receiver adds them up."""


class RequestUpdate(msgspec.Struct, gc=False):
    """What a step did to one request: the tokens it accepted and, if it ended, why."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    """``stop``, ``length``, ``abort`` or ``error`` once finished, else None."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that finished the request."""
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at first admission."""
    error: RequestError | None = None
    """Set when ``finish_reason`` is ``error``."""
    timing: RequestTiming | None = None
    """On the update that carries the request's first token."""
    model_time: RequestModelTime | None = None
    """--collect-detailed-traces: on every update, the request's worker time so far."""


class SchedulerStats(msgspec.Struct, gc=False):
    num_running: int
    num_waiting: int
    num_preemptions: int
    """Preemptions since start."""
    kv_usage: float
    """Fraction of KV blocks held by requests."""
    num_free_blocks: int
    prefix_queries: int
    """Prompt tokens looked up in the prefix cache since start."""
    prefix_hits: int
    """Of those, tokens served from the cache."""
    offload_hits: int = 0
    """Prompt tokens loaded back from the offload tiers instead of being recomputed (cumulative)."""
    num_loading: int = 0
    """Requests waiting for their prefix to be loaded from the offload tiers."""
    num_steps: int = 0
    """Engine steps run since start (a prompt prefilled in chunks takes one per chunk, a multi-step
    decode one per decode step); the scheduler's shell counts them."""
    mm_encoder_runs: int = 0
    """Images the worker ran through the vision tower since start,"""
    mm_encoder_cache_hits: int = 0
    """and images whose feature rows came from its encoder cache instead."""
    steps_overlapped: int = 0
    """Steps sent while an earlier one was still running (async scheduling, pipeline stages),
    since start; the scheduler's shell counts them."""
    spec_num_drafts: int = 0
    """Speculative decoding, since start: steps of a request that carried drafts,"""
    spec_num_draft_tokens: int = 0
    """the drafts they carried,"""
    spec_num_accepted_tokens: int = 0
    """the drafts accepted,"""
    spec_accepted_per_position: list[int] = msgspec.field(default_factory=list)
    """and those accepted at each position of a step's drafts (0-based)."""
    running_loras: list[str] = msgspec.field(default_factory=list)
    """The names of the LoRA adapters of the running requests (sorted),"""
    waiting_loras: list[str] = msgspec.field(default_factory=list)
    """and of the waiting ones."""
    kv_residency: KVResidencyStats | None = None
    """--kv-cache-metrics: the sampled blocks' residency histograms since start."""
    mfu: MFUStats | None = None
    """--enable-mfu-metrics: the steps' estimated FLOPs and bytes, and the worker's time; the
    scheduler's shell counts them."""
