"""The messages the engine's actors exchange (one tagged union per actor)."""

from __future__ import annotations

from typing import Any, Union

import msgspec

from sonar.actors import ActorRef, Ask
from sonar.actors.messages import RemoteError
from sonar.core.outputs import (
    RequestError,
    RequestModelTime,
    RequestTiming,
    RequestUpdate,
    SchedulerOutput,
    SchedulerStats,
)
from sonar.core.request import LoRARequest
from sonar.core.sleep import SleepState
from sonar.errors import Rejection
from sonar.pooling_params import PooledData, PoolingInfo, PoolingParams
from sonar.sampling_params import SamplingParams


# -- multimodal ----------------------------------------------------------------------------------
class VisionInfo(msgspec.Struct):
    """What the frontend needs to turn a model's images into prompt tokens and pixels."""

    image_token_id: int
    tokens_per_image: int
    """Placeholder tokens one image takes in the prompt (its feature rows)."""
    image_size: int
    """Side of the square pixel input the vision tower takes (0: any size, `patch_size` set)."""
    image_text: str | None = None
    """What an image part becomes in the text the chat template renders (None: the image token)."""
    patch_size: int = 0
    """Dynamic resolution (Qwen2-VL): the side of a patch; 0 for a tower of one input size. Each
    image then takes ``t * h * w / merge_size ** 2`` tokens for its grid of patches ``(t, h, w)``,
    and `tokens_per_image` is 0."""
    merge_size: int = 0
    temporal_patch_size: int = 0
    feature_width: int = 0
    """Columns of an image's feature row where they are more than the model's hidden size
    (Qwen3-VL: its DeepStack rows beside it); 0: the hidden size."""
    grid_pinpoints: list[list[int]] | None = None
    """Any resolution (LLaVA-NeXT, `sonar.core.anyres`): the ``(height, width)`` resolutions an
    image is tiled into, in tiles of `image_size` pixels. An image's pixels are then its tiles
    ``[n, 3, image_size, image_size]`` (the base image first), its `ImageInput.grid` its original
    ``(height, width)``, which fixes its token count; `tokens_per_image` is 0."""
    tile_patch_size: int = 0
    """With `grid_pinpoints`: the tower's patch side (a tile gives ``(image_size / tile_patch_size) ** 2`` rows)."""
    processor: str = "clip"
    """A fixed-size tower's image processor: ``clip`` (resize, center crop) or ``gemma3`` (resize
    to the square, no crop: `sonar.multimodal.gemma3`)."""
    bidirectional: bool = False
    """An image's tokens attend to each other in prefill (Gemma 3): the scheduler never ends a
    prefill chunk inside an image."""


class ImageInput(msgspec.Struct, array_like=True):
    """One image of a prompt: its placeholder tokens ``[offset, offset + length)`` of the prompt,
    the hash of its pixels (which keys its blocks in the prefix cache), and the pixels the vision
    tower takes (a float32 CPU tensor ``[3, image_size, image_size]``; with dynamic resolution its
    patches ``[t * h * w, 3 * temporal_patch_size * patch_size ** 2]`` and their `grid` ``(t, h, w)``).
    With `embeds` (--enable-mm-embeds) `pixel_values` holds the image's precomputed feature rows
    instead, float32 ``[length, hidden_size]``, which the worker takes without the tower."""

    offset: int
    length: int
    hash: str
    pixel_values: Any
    grid: list[int] | None = None
    embeds: bool = False


# -- worker --------------------------------------------------------------------------------------
class WorkerInfo(msgspec.Struct):
    """What the scheduler and the frontend need to know about the loaded model and its cache."""

    model: str
    architecture: str
    dtype: str
    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    kv_cache_memory_bytes: int
    tokenizer_path: str | None
    pid: int
    startup_seconds: dict[str, float] = {}
    """Where the worker's start-up went, by phase: "weights", "convert", "kv_cache", "warmup"."""
    num_layers: int = 0
    """The KV cache's shape (per layer ``[2, num_blocks, block_size, num_kv_heads, head_dim]``):
    the offload manager builds its chunk layout from it."""
    num_kv_heads: int = 0
    head_dim: int = 0
    device: str = "cpu"
    """The device type the model runs on ("cpu", "cuda")."""
    device_name: str = ""
    """The GPU's name (``torch.cuda.get_device_name``); empty on the CPU."""
    instance: str = ""
    """Random id of this run of the worker: a restarted worker answers with another."""
    tensor_parallel_size: int = 1
    """Ranks each layer is split over; this answer is rank 0's (its pid, its share of the KV cache)."""
    pipeline_parallel_size: int = 1
    """Stages the layers are partitioned into (`num_layers` counts rank 0's)."""
    projections: dict[str, tuple[int, int]] = {}
    """The decoder's projections, ``(in_features, out_features)`` by name, whole (not a rank's):
    what a LoRA adapter is checked against (`sonar.lora.adapter.ModelShapes`)."""
    num_hidden_layers: int = 0
    """The model's decoder layers (all stages')."""
    pooling: PoolingInfo | None = None
    """A pooling model (``--runner pooling``): what it serves; None for a generative model."""
    hidden_size: int = 0
    """The width of the model's input embeddings (what a prompt given as embeddings must have)."""
    sleep: SleepState = SleepState()
    """Sleep mode: what is asleep now (a scheduler that starts beside a sleeping worker sleeps too)."""
    vision: VisionInfo | None = None
    """A model that takes images (`sonar.models.llava`); None for a text-only model."""
    weights_bytes: int = 0
    """The model's parameter bytes as loaded on this rank (a vision model served with an image
    limit of 0 holds no tower: `sonar.models.loader.drop_tower`)."""
    longrope_switch: int | None = None
    """LongRoPE (Phi-3, Phi-4): the length past which a sequence takes the long factors
    (`sonar.models.rotary`), where ``max_model_len`` goes past it; None otherwise."""


class DescribeWorker(Ask, tag="worker.describe"):
    reply_type = WorkerInfo


class NewRequestData(msgspec.Struct, array_like=True):
    """Per-request state the worker keeps while a request runs (sent on its first step)."""

    req_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    lora: LoRARequest | None = None
    pooling: PoolingParams | None = None
    """A pooling request: the worker pools its prompt instead of sampling."""
    images: list[ImageInput] = []
    """The prompt's images, in position order."""
    prompt_embeds: bytes | None = None
    """The prompt's input embeddings (float32, ``[len(prompt_token_ids), hidden_size]``, C order),
    fed to the model in place of the placeholder `prompt_token_ids`."""


class TokenLogprobs(msgspec.Struct, array_like=True):
    """For one position: the chosen token, then the top-N alternatives (ids, logprobs), its rank."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int


class WorkerSpan(msgspec.Struct, array_like=True, gc=False):
    """--collect-detailed-traces: one timed part of a step on the worker, in nanoseconds since the
    epoch (the worker's monotonic clock, converted where it was read)."""

    name: str
    start_ns: int
    end_ns: int


class StepResult(msgspec.Struct):
    step_id: int
    sampled: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]] = {}
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = {}
    seconds: float = 0.0
    forward_seconds: float = 0.0
    """--collect-detailed-traces model: the forward pass's share of `seconds` (else 0)."""
    failed: dict[str, str] = {}
    """Requests for which no token could be sampled (not in `sampled`), with why: the
    scheduler fails them alone."""
    proposed: dict[str, list[int]] = {}
    """Speculative decoding with a draft model: the drafts for each sampled request's next step."""
    drafted: dict[str, int] = {}
    """Speculation with async scheduling: how many drafts the runner made for each request whose
    step had draft slots (`SchedulerConfig.worker_drafts`)."""
    uncache: list[str] = []
    """Of the `failed` requests, those whose KV of this step is not theirs (their LoRA adapter
    could not be loaded): their blocks must leave the prefix cache."""
    pooled: dict[str, PooledData] = {}
    """Pooling requests whose prompt this step completed, with their result: they are done."""
    spans: list[WorkerSpan] = []
    """--collect-detailed-traces with step spans exported (`EngineConfig.step_spans`): the
    worker's ``worker.execute`` and ``worker.sample`` (``worker``) and ``model.forward``
    (``model``), children of the scheduler's span of the step."""
    images_encoded: int = 0
    """Images this step ran through the vision tower,"""
    images_reused: int = 0
    """and images whose rows it took from the worker's encoder cache instead."""


class ExecuteStep(Ask, tag="worker.step"):
    output: SchedulerOutput
    new_requests: list[NewRequestData] = []
    fault: str | None = None
    """--fault-injection: "raise", "hang" or "exit" makes this step fail that way (tests, drills)."""
    grammar_rows: list[str] = []
    """Structured outputs: the requests of this step that sample under a grammar, in step order.
    Their bitmask follows in a `StepBitmask` of the same step id, which the step waits for (after
    its forward pass) before it samples."""
    fault_rank: int = 0
    """The rank of a tensor/pipeline group that carries `fault` out."""
    streamed: list[str] = []
    """A multi-step decode (`SchedulerOutput.decode_steps`): the requests that stream. What each
    decode step but the last samples for them goes to the scheduler as a `StepTokens` while the
    next decode step runs."""
    reply_type = StepResult


class StepBitmask(msgspec.Struct, tag="worker.bitmask"):
    """The tokens the grammar rows of step ``step_id`` may sample: row ``i`` of ``bitmask`` (a
    torch int32 CPU tensor ``[len(grammar_rows), ceil(vocab / 32)]``, `sonar.structured.bitmask`)
    is for ``ExecuteStep.grammar_rows[i]``. The scheduler sends it as soon as the matchers have
    taken the tokens of the step before, so it is filled while the step's forward pass runs."""

    step_id: int
    bitmask: Any


class CutSteps(msgspec.Struct, tag="worker.cut"):
    """End multi-step decode ``step_id`` (`SchedulerOutput.decode_steps`) after the decode step it
    is running: a request arrived, and it gets the next step instead of waiting out the rest. Its
    result has the tokens of the steps that ran. Late or for another step, it changes nothing."""

    step_id: int


class JoinGroup(Ask, tag="worker.join"):
    """To a tensor-parallel rank other than 0, from rank 0: join this incarnation of the group at
    the rendezvous store ``host:port`` and load the model's shards; answered once it has (no value).
    From then on the rank runs every `ExecuteStep` rank 0 forwards to it, and answers none.
    ``prefix``: this incarnation's keys in a store that outlives it (several nodes meet at
    ``--master-addr:--master-port``, one store for the head's lifetime); empty: a store of its own."""

    host: str
    port: int
    prefix: str = ""


class StepDone(msgspec.Struct, tag="worker.done"):
    """From the sampler (the last pipeline stage) to rank 0: the result of step ``step_id``, or
    the error it failed with, which rank 0 answers the scheduler's `ExecuteStep` with."""

    step_id: int
    result: StepResult | None = None
    error: RemoteError | None = None
    """Set when the step failed on the sampler."""


class Sleep(Ask, tag="worker.sleep"):
    """Free the KV cache tensors and move the weights to host memory (level 1) or drop them
    (level 2) (`sonar.core.sleep`). The scheduler sends it once no request runs; answered with
    the worker's new state once the memory is freed."""

    level: int
    reply_type = SleepState


class WakeUp(Ask, tag="worker.wake"):
    """Restore what `tags` name (weights, kv_cache) of what sleeps; answered with the new state."""

    tags: list[str]
    reply_type = SleepState


class ProfileStatus(msgspec.Struct):
    """What the profiler of a worker (and of the other ranks of its group) did."""

    running: bool
    traces: list[str] = []
    """The trace files written (`StopProfile`)."""


class StartProfile(Ask, tag="worker.start_profile"):
    """Start the torch profiler (``--profiler-config``) around this worker's steps."""

    reply_type = ProfileStatus


class StopProfile(Ask, tag="worker.stop_profile"):
    """Stop the torch profiler and write its trace (answered once the file is written)."""

    reply_type = ProfileStatus


class WeightsUpdated(msgspec.Struct):
    """A weight update done (`sonar.engine.weights`)."""

    tensors: int
    """Checkpoint tensors written."""
    bytes: int
    seconds: float
    updates: int
    """Updates this worker has applied since it started (a restarted worker serves the startup
    checkpoint again, and counts from 0)."""


class UpdateWeights(Ask, tag="worker.update_weights"):
    """Write new weights between steps: the safetensors checkpoint folder at `path`, or `tensors`
    (checkpoint name -> tensor, in the served dtype); checked against the served model first."""

    path: str | None = None
    tensors: dict[str, Any] | None = None
    reply_type = WeightsUpdated


WorkerMsg = Union[
    DescribeWorker,
    ExecuteStep,
    StepBitmask,
    CutSteps,
    JoinGroup,
    StepDone,
    Sleep,
    WakeUp,
    StartProfile,
    StopProfile,
    UpdateWeights,
]


# -- scheduler -----------------------------------------------------------------------------------
class Accepted(msgspec.Struct):
    """The scheduler's answer to `AddRequest`: queued (`rejected` None), or refused and why."""

    rejected: Rejection | None = None


class AddRequest(Ask, tag="scheduler.add"):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sink: ActorRef[FrontendMsg]
    """The frontend (client actor) that receives this request's `Outputs`."""
    priority: int = 0
    cache_salt: str | None = None
    arrival_time: float | None = None
    lora: LoRARequest | None = None
    """The LoRA adapter the request runs with (None: the base model)."""
    pooling: PoolingParams | None = None
    """A pooling request (a pooling worker only): it ends with its prompt, with a pooled result."""
    images: list[ImageInput] = []
    """The prompt's images, in position order (a model that takes images only)."""
    prompt_embeds: bytes | None = None
    """The prompt as input embeddings (`NewRequestData.prompt_embeds`); `prompt_token_ids` are
    placeholders then, and `cache_salt` keys the prefix cache by the embeddings."""
    stream: bool = True
    """Its tokens are shown as they come; False: only once it ends (`generate`, a completion
    without ``stream``), so the engine may pass them on a multi-step decode at a time."""
    reply_type = Accepted


class Abort(msgspec.Struct, tag="scheduler.abort"):
    request_ids: list[str]


class StopStringHit(msgspec.Struct, tag="scheduler.stop_string"):
    """The detokenizer found a stop string: finish these requests."""

    hits: dict[str, str]


class GetStats(Ask, tag="scheduler.stats"):
    reply_type = SchedulerStats


class CountRequests(Ask, tag="count_requests"):
    """How many requests the actor holds state for (leak checks, `/metrics`)."""

    reply_type = int


class CacheState(msgspec.Struct):
    """What the scheduler's KV cache holds (tests, diagnostics)."""

    block_hashes: list[bytes]
    """Hashes of the blocks of the primary (device) cache that are in the prefix cache."""
    tier_epoch: str | None
    """The run of the offload manager whose tiers the scheduler's lookup mirror follows (None:
    none yet, or no offloading)."""


class DescribeCache(Ask, tag="scheduler.cache"):
    reply_type = CacheState


class KVLoaded(msgspec.Struct, tag="scheduler.kv_loaded"):
    """From the worker: the load ``load_id`` of ``req_id`` put ``num_blocks`` blocks (from the load's
    ``start_block``) into the primary cache; 0 when it failed (the blocks are then recomputed)."""

    req_id: str
    num_blocks: int
    load_id: int


class SleepReply(msgspec.Struct):
    """The engine's sleep state after a `SleepEngine` or `WakeEngine` (or as `GetSleepState` finds
    it); `refused` says why the change did not happen (the state is then unchanged)."""

    state: SleepState
    refused: str | None = None


class SleepEngine(Ask, tag="scheduler.sleep"):
    """Go to sleep at `level`: refuse new requests, wait (up to `drain_timeout` seconds) for the
    running ones to finish, drop the prefix cache and put the worker to sleep."""

    level: int
    drain_timeout: float
    reply_type = SleepReply


class WakeEngine(Ask, tag="scheduler.wake"):
    """Wake the worker's `tags` (`sonar.core.sleep.TAGS`); requests are taken again once all are awake."""

    tags: list[str]
    reply_type = SleepReply


class GetSleepState(Ask, tag="scheduler.sleep_state"):
    reply_type = SleepReply


class WeightUpdateReply(msgspec.Struct):
    """The answer to `UpdateEngineWeights`: what was written, or why nothing was (`refused`: the
    update does not fit; `failed`: the worker failed, and restarts with the startup checkpoint)."""

    updated: WeightsUpdated | None = None
    refused: str | None = None
    failed: str | None = None
    conflict: bool = False
    """`refused` because it cannot happen now (another update under way, weights asleep)."""


class UpdateEngineWeights(Ask, tag="scheduler.update_weights"):
    """Update the worker's weights between steps (`UpdateWeights`), then drop the prefix cache."""

    path: str | None = None
    tensors: dict[str, Any] | None = None
    reply_type = WeightUpdateReply


class StepTokens(msgspec.Struct, tag="scheduler.step_tokens"):
    """Decode step ``index`` of multi-step decode ``step_id`` sampled these tokens (one for each
    request of `ExecuteStep.streamed` that has not failed), sent by the worker as the next decode
    step starts, so that they stream now rather than when the whole step answers. The step's
    result repeats them: the scheduler keeps count of what it applied, and drops one that comes
    late or out of order."""

    step_id: int
    index: int
    sampled: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]] = {}


SchedulerMsg = Union[
    AddRequest,
    Abort,
    StopStringHit,
    GetStats,
    CountRequests,
    DescribeCache,
    KVLoaded,
    SleepEngine,
    WakeEngine,
    GetSleepState,
    UpdateEngineWeights,
    StepTokens,
]


# -- detokenizer ---------------------------------------------------------------------------------
class TrackRequest(msgspec.Struct, array_like=True):
    req_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    sink: ActorRef[FrontendMsg]


class StepOutputs(msgspec.Struct, tag="detok.step"):
    """From the scheduler after each step: requests that started, what each step did, logprobs."""

    new: list[TrackRequest]
    updates: list[RequestUpdate]
    logprobs: dict[str, list[TokenLogprobs]] = {}
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = {}
    pooled: dict[str, PooledData] = {}


class Forget(msgspec.Struct, tag="detok.forget"):
    request_ids: list[str]


DetokenizerMsg = Union[StepOutputs, Forget, CountRequests]


# -- frontend (the library's client, later the HTTP server) -------------------------------------
class Logprob(msgspec.Struct, array_like=True):
    token_id: int
    token: str
    logprob: float


class PositionLogprobs(msgspec.Struct, array_like=True):
    """The chosen token's logprob and the top alternatives at one position."""

    token_id: int
    token: str
    logprob: float
    rank: int
    top: list[Logprob]


class OutputDelta(msgspec.Struct, array_like=True):
    req_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    error: RequestError | None = None
    """Why the request failed alone (``finish_reason`` ``error``); the frontend raises it."""
    pooled: PooledData | None = None
    """A pooling request's result, on its final delta."""
    timing: RequestTiming | None = None
    """On the delta of the request's first token: its queue time and time to first token."""
    model_time: RequestModelTime | None = None
    """--collect-detailed-traces: the request's worker time so far."""


class Outputs(msgspec.Struct, tag="frontend.outputs"):
    deltas: list[OutputDelta]


class EngineFailed(msgspec.Struct, tag="frontend.failed"):
    """The engine cannot finish these requests (it gave up, or lost their state)."""

    request_ids: list[str]
    reason: str


FrontendMsg = Union[Outputs, EngineFailed]
