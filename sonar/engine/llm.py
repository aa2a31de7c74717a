"""`LLM`, the handle on a running engine (what `sonar.open` yields), and the outputs it returns.

The handle is where a request enters the engine: it validates the request once (sampling
parameters, the engine's per-request limits, token ids inside the vocabulary, a structured output
spec compiled through the process's grammar cache), tokenizes off the
event loop, asks the scheduler to take it (`AddRequest`; a refusal comes back as a typed
`Rejection` and is raised as its exception) and reads the request's outputs from the stream the
client actor fills (`sonar.engine.client_actor`).

With data parallelism (`sonar.engine.replicas`) the handle is also where a request is routed: the
router core (`sonar.core.routing`) picks the replica from the prompt's prefix-cache block hashes and
the replicas' load, and the request's messages (add, abort) go to that replica's scheduler; stats,
request counts and health are read from every replica.
"""

from __future__ import annotations

import itertools
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Mapping, Sequence

import anyio
import anyio.to_thread
import msgspec

from sonar.actors import ActorError, ActorInfo, ActorNotFound, AskTimeout, Supervisor
from sonar.core.flops import MFUStats
from sonar.core.kv_residency import KVResidencyStats
from sonar.core.outputs import RequestError, RequestModelTime, RequestTiming, SchedulerStats
from sonar.core.prefix import PrefixHasher
from sonar.core.request import LoRARequest, cache_salt_problem
from sonar.core.routing import Router
from sonar.core.sleep import SleepRefusedError, SleepState, check_level, check_tags
from sonar.core.weights import WeightTransferConfig, WeightUpdateConflictError, WeightUpdateError
from sonar.engine.client_actor import DeltaStream, Failed, Moved
from sonar.engine.config import EngineConfig
from sonar.engine.logits_processors import load_classes, validate_params
from sonar.engine.prompt_embeds import PLACEHOLDER, check_prompt_embeds, embeds_salt, is_embeds_prompt
from sonar.engine.replay import Replay
from sonar.engine.replicas import Replicas
from sonar.engine.tree import worker_ref
from sonar.errors import (
    EngineDeadError,
    InvalidRequestError,
    LoRAError,
    LoRANotFoundError,
    NotEnabledError,
    RequestQuarantinedError,
    SamplingFailedError,
    ServerOverloadedError,
    SonarError,
)
from sonar.log import get_logger
from sonar.lora.limits import ModelShapes
from sonar.lora.registry import LoRARegistry, ServedAdapter
from sonar.multimodal.limits import image_limit
from sonar.multimodal.media import image_io
from sonar.pooling_params import PooledData, PoolingInfo, PoolingParams, PoolingParamsError
from sonar.protocol.engine import (
    Abort,
    AddRequest,
    CountRequests,
    DescribeWorker,
    GetSleepState,
    GetStats,
    ImageInput,
    OutputDelta,
    PositionLogprobs,
    SleepEngine,
    SleepReply,
    StartProfile,
    StopProfile,
    UpdateEngineWeights,
    VisionInfo,
    WakeEngine,
    WeightsUpdated,
    WeightUpdateReply,
    WorkerInfo,
)
from sonar.sampling_params import SamplingParams, SamplingParamsError, over_limit
from sonar.structured import compiler_for

log = get_logger("sonar.frontend")

Prompt = str | Sequence[int] | Mapping[str, Any]
"""Text, token ids, or ``{"prompt_embeds": tensor}`` (`sonar.engine.prompt_embeds`)."""

ADD_TIMEOUT = 30.0
"""Seconds the scheduler may take to accept or refuse a request before it counts as saturated."""

RETRY_AFTER = 1.0
"""Seconds an overloaded engine asks a client to wait before it tries again."""

SLEEP_DRAIN_TIMEOUT = 60.0
"""Seconds `LLM.sleep` waits, by default, for the running requests to finish."""
MAX_SLEEP_DRAIN_TIMEOUT = 3600.0
ASK_MARGIN = 30.0
"""Seconds a sleep or wake-up ask waits past the scheduler's own deadline, so that the scheduler's
answer (a refusal included) arrives before this side gives up."""

RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
"""Arguments of `apply_chat_template` itself, which chat_template_kwargs may not set."""


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] | None = None


@dataclass
class RequestOutput:
    """A finished request. `text`, `token_ids`, ... are those of the first (often only) completion."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.outputs[0].stop_reason

    @property
    def logprobs(self) -> list[PositionLogprobs] | None:
        return self.outputs[0].logprobs


@dataclass
class StreamDelta:
    """New output of one completion (`index`) of a streamed request."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    pooled: PooledData | None = None
    timing: RequestTiming | None = None
    """On the delta of the first token: the scheduler's queue time and time to first token."""
    model_time: RequestModelTime | None = None
    """--collect-detailed-traces: the request's worker time so far."""


@dataclass
class PoolingOutput:
    """A pooling request's result: an embedding, class probabilities, or one row per token."""

    request_id: str
    prompt_token_ids: list[int]
    data: PooledData

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class LLM:
    """Handle on a running engine; see `sonar.open`."""

    def __init__(
        self,
        config: EngineConfig,
        supervisor: Supervisor,
        client: Any,
        streams: dict[str, DeltaStream],
        info: WorkerInfo,
        tokenizer: Any,
    ) -> None:
        self.config = config
        self.supervisor = supervisor
        """The engine tree's supervisor (with data parallelism, the one above the replicas)."""
        self.replicas = Replicas(supervisor, config.data_parallel_size)
        self.router: Router | None = None
        """Picks each request's replica (None: one replica)."""
        self._hasher: PrefixHasher | None = None
        if self.replicas.count > 1:
            self.router = Router(
                self.replicas.count,
                capacity=info.num_blocks,
                prefix_affinity=config.data_parallel_routing == "prefix",
                balance_slack=max(4, config.max_num_seqs // 16),
            )
            if config.enable_prefix_caching:
                self._hasher = PrefixHasher(config.block_size, config.prefix_caching_hash_algo)
        self._routes: dict[str, int] = {}
        """The replica of each engine request in flight."""
        self._moves = 0
        """Requests moved off lost replicas so far (each move's engine ids are new)."""
        self.info = info
        self.tokenizer = tokenizer
        self._client = client
        self._streams = streams
        self._ids = itertools.count()
        self._prefix = secrets.token_hex(4)
        self._closed = False
        self._processor_classes: list[type] | None = None
        """--logits-processors, imported on the first request (for their `validate_params`)."""
        self.dead: str | None = None
        """Why the engine can serve no more (it gave up), or None."""
        self.root: Supervisor | None = None
        """The supervisor above the engine's, when there is one (`sonar serve`'s root)."""
        self.model_name = config.model or info.model
        """The name adapters' ``parent`` defaults to (`sonar serve` sets its first served name)."""
        self.lora_registry: LoRARegistry | None = None
        """The LoRA adapters served by name (None: LoRA is off)."""
        if config.enable_lora:
            shapes = ModelShapes({k: tuple(v) for k, v in info.projections.items()}, info.num_hidden_layers)
            self.lora_registry = LoRARegistry(shapes, config.lora_limits())
        self.image_limit = image_limit(config.limit_mm_per_prompt, config.language_model_only)
        """Most images one prompt may hold (--limit-mm-per-prompt, --language-model-only)."""
        self.image_io = image_io(config.media_io_kwargs)
        """How the server decodes a request's images (--media-io-kwargs)."""
        self._image_processor: Any = None
        from sonar.multimodal.cache import ProcessedCache

        self.processed_images = ProcessedCache(int(config.mm_processor_cache_gb * 2**30))
        """Processed pictures by their bytes (--mm-processor-cache-gb; a budget of 0 keeps none)."""

    # -- public API -------------------------------------------------------------------------
    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        request_id: str | None = None,
        lora: str | None = None,
        on_delta: Callable[[StreamDelta], None] | None = None,
        images: Sequence[ImageInput] = (),
    ) -> RequestOutput:
        """Generate a completion of `prompt` (text or token ids) and return it when finished.

        `lora`: the name of a loaded LoRA adapter to run with (None: the base model). `images`:
        the prompt's images, placed on its image tokens (`add_images` makes both).
        `on_delta`, if given, sees each `StreamDelta` as it arrives (for timing metrics)."""
        params = params or SamplingParams()
        adapter = self._adapter(lora)
        prompt_ids, text, embeds = await self._prepare(prompt, params)
        rid = request_id or self._new_id()
        outputs = [CompletionOutput(i) for i in range(params.n)]
        result = RequestOutput(rid, text, prompt_ids, outputs)
        async for delta in self._run(
            rid, prompt_ids, params, priority, cache_salt, adapter, images=images, prompt_embeds=embeds, streamed=False
        ):
            if on_delta is not None:
                on_delta(delta)
            out = outputs[delta.index]
            out.text += delta.text
            out.token_ids += delta.token_ids
            if delta.logprobs:
                out.logprobs = (out.logprobs or []) + delta.logprobs
            if delta.prompt_logprobs is not None:
                result.prompt_logprobs = (result.prompt_logprobs or []) + delta.prompt_logprobs
            if delta.finish_reason is not None:
                out.finish_reason, out.stop_reason = delta.finish_reason, delta.stop_reason
            result.num_cached_tokens = max(result.num_cached_tokens, delta.num_cached_tokens)
        if params.logprobs is not None:
            for out in outputs:
                out.logprobs = out.logprobs or []
        return result

    async def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        request_id: str | None = None,
        lora: str | None = None,
        images: Sequence[ImageInput] = (),
    ) -> AsyncIterator[StreamDelta]:
        """Yield `StreamDelta`s as tokens are produced; leaving the loop early aborts the request."""
        params = params or SamplingParams()
        adapter = self._adapter(lora)
        prompt_ids, _, embeds = await self._prepare(prompt, params)
        rid = request_id or self._new_id()
        async for delta in self._run(
            rid, prompt_ids, params, priority, cache_salt, adapter, images=images, prompt_embeds=embeds
        ):
            yield delta

    async def encode(
        self,
        prompt: Prompt,
        pooling: PoolingParams | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        priority: int = 0,
        request_id: str | None = None,
        lora: str | None = None,
    ) -> PoolingOutput:
        """Run `prompt` (text or token ids) through a pooling model and return its result
        (`pooling`: the task and its options; None: the model's first task with its defaults).

        A prompt longer than the model's context is refused unless `truncate_prompt_tokens` says
        how many tokens to keep (-1: as many as the model takes): text is cut by its tokenizer
        (which keeps its special tokens), token ids keep their last ones. Text is lowercased first
        where the model's sentence-transformers folder says ``do_lower_case``."""
        if is_embeds_prompt(prompt):
            raise InvalidRequestError("pooling requests take text or token ids, not prompt_embeds", "prompt_embeds")
        info = self.pooling_info()
        pooling = pooling or PoolingParams(task=info.tasks[0])
        try:
            pooling.check(info)
        except PoolingParamsError as exc:
            raise InvalidRequestError(str(exc), param=exc.param) from None
        adapter = self._adapter(lora)
        if isinstance(prompt, str) and info.lower_case:  # as sentence-transformers does before tokenizing
            prompt = prompt.lower()
        ids = await self._pooling_prompt(prompt, truncate_prompt_tokens)
        if pooling.pair_start is not None and not 0 < pooling.pair_start < len(ids):
            raise InvalidRequestError(
                f"pair_start {pooling.pair_start} is not inside the prompt's {len(ids)} tokens", param="pair_start"
            )
        rid = request_id or self._new_id()
        pooled = None
        async for delta in self._run(rid, ids, SamplingParams(), priority, None, adapter, pooling):
            pooled = delta.pooled or pooled
        if pooled is None:  # the engine finished it without a result: a bug, not the caller's
            raise SonarError(f"request {rid!r} finished without a pooling result")
        return PoolingOutput(rid, ids, pooled)

    async def embed(
        self,
        prompt: Prompt,
        *,
        dimensions: int | None = None,
        normalize: bool | None = None,
        truncate_prompt_tokens: int | None = None,
        priority: int = 0,
        request_id: str | None = None,
    ) -> PoolingOutput:
        """`encode` with the ``embed`` task: one vector for the prompt."""
        params = PoolingParams(task="embed", dimensions=dimensions, normalize=normalize)
        return await self.encode(
            prompt, params, truncate_prompt_tokens=truncate_prompt_tokens, priority=priority, request_id=request_id
        )

    async def classify(
        self,
        prompt: Prompt,
        *,
        use_activation: bool | None = None,
        truncate_prompt_tokens: int | None = None,
        priority: int = 0,
        request_id: str | None = None,
    ) -> PoolingOutput:
        """`encode` with the ``classify`` task: one value per label (`PoolingInfo.labels`),
        probabilities unless `use_activation` is False."""
        params = PoolingParams(task="classify", use_activation=use_activation)
        return await self.encode(
            prompt, params, truncate_prompt_tokens=truncate_prompt_tokens, priority=priority, request_id=request_id
        )

    async def reward(
        self,
        prompt: Prompt,
        *,
        truncate_prompt_tokens: int | None = None,
        priority: int = 0,
        request_id: str | None = None,
    ) -> PoolingOutput:
        """A reward model's (``--convert reward``) per-token rewards: `encode` with its token task,
        one row per prompt token (its head's logits, or its hidden states without a head; the last
        row is a sequence classifier's reward of the whole prompt). `InvalidRequestError` for a
        model not served as one."""
        info = self.pooling_info()
        if not info.reward:
            raise InvalidRequestError(
                "this model is not served as a reward model: serve it with --convert reward for per-token rewards",
                param="model",
            )
        return await self.encode(
            prompt,
            PoolingParams(task=info.tasks[0]),
            truncate_prompt_tokens=truncate_prompt_tokens,
            priority=priority,
            request_id=request_id,
        )

    def pooling_info(self) -> PoolingInfo:
        """What the pooling model serves; `InvalidRequestError` for a generative model."""
        if self.info.pooling is None:
            raise InvalidRequestError(
                "this model is not a pooling model: serve it with --runner pooling (or --convert embed / "
                "--convert classify / --convert reward) for embeddings, classification, scores and rewards",
                param="model",
            )
        return self.info.pooling

    async def _pooling_prompt(self, prompt: Prompt, truncate: int | None) -> list[int]:
        self._check_open()
        limit = self.info.max_model_len
        if truncate is not None:
            if isinstance(truncate, bool) or not isinstance(truncate, int) or truncate == 0 or truncate < -1:
                raise InvalidRequestError(
                    f"truncate_prompt_tokens must be -1 (the model's length) or positive, got {truncate!r}",
                    param="truncate_prompt_tokens",
                )
            if truncate > limit:
                raise InvalidRequestError(
                    f"truncate_prompt_tokens {truncate} is more than the model's maximum context length {limit}",
                    param="truncate_prompt_tokens",
                )
            keep = limit if truncate == -1 else truncate
        if isinstance(prompt, str):
            self.check_prompt_chars(prompt, "input")
            if truncate is None:
                ids = await self.tokenize(prompt)
            else:
                ids = await anyio.to_thread.run_sync(
                    lambda: list(self.tokenizer(prompt, truncation=True, max_length=keep).input_ids)
                )
        else:
            ids = [int(t) for t in prompt]
            self.check_token_ids(ids, "input")
            if truncate is not None:
                ids = ids[-keep:]
        if not ids:
            raise InvalidRequestError("the input is empty", param="input")
        if len(ids) > limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, the input has {len(ids)} "
                "tokens. Please reduce the length of the input, or set truncate_prompt_tokens.",
                param="input",
                code="context_length_exceeded",
            )
        return ids

    async def chat(
        self,
        messages: list[dict[str, Any]],
        params: SamplingParams | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> RequestOutput:
        """Apply the model's chat template to `messages` (see `apply_chat_template`), then `generate`."""
        prompt_ids = await self.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
        )
        return await self.generate(prompt_ids, params, **kwargs)

    async def generate_many(
        self, prompts: Sequence[Prompt], params: SamplingParams | None = None, **kwargs: Any
    ) -> list[RequestOutput]:
        """Generate for all prompts at once (continuous batching); results in prompt order."""
        self.check_completions(len(prompts), params or SamplingParams())
        results: list[RequestOutput | None] = [None] * len(prompts)

        async def one(i: int, p: Prompt) -> None:
            results[i] = await self.generate(p, params, **kwargs)

        async with anyio.create_task_group() as tg:
            for i, p in enumerate(prompts):
                tg.start_soon(one, i, p)
        return results  # type: ignore[return-value]

    async def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The token ids of `messages` rendered by the chat template (`chat_template`, else the
        tokenizer's), as transformers' `apply_chat_template` renders them: `tools` (a list of
        `{"type": "function", "function": {...}}` dicts) reach the template as `tools`, and
        `chat_template_kwargs` as extra template variables (none may replace an argument of the
        call itself, such as `tools`: `RESERVED_TEMPLATE_KWARGS`)."""
        if add_generation_prompt and continue_final_message:
            raise InvalidRequestError("add_generation_prompt and continue_final_message cannot both be set")
        extra = dict(chat_template_kwargs or {})
        reserved = sorted(set(extra) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise InvalidRequestError(
                f"chat_template_kwargs cannot set {reserved[0]!r}: it is an argument of the template call itself",
                param=f"chat_template_kwargs.{reserved[0]}",
            )
        limit = self.config.max_chat_messages
        if len(messages) > limit:
            raise InvalidRequestError(
                over_limit("messages", limit, len(messages), "max_chat_messages"), param="messages"
            )

        def render() -> list[int]:
            try:
                text = self.tokenizer.apply_chat_template(
                    messages,
                    tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    chat_template=chat_template,
                    tools=tools,
                    **extra,
                )
            except Exception as exc:
                raise InvalidRequestError(f"cannot apply the chat template: {exc}", param="messages") from exc
            self.check_prompt_chars(text, "messages")
            return self.tokenizer(text, add_special_tokens=False).input_ids

        return await anyio.to_thread.run_sync(render)

    def check_images(
        self, prompt_ids: Sequence[int], count: int, max_tokens: int | None = None, embeds: int = 0
    ) -> VisionInfo:
        """Refuse `count` images (`embeds` of them given as feature rows) for a prompt before any
        is loaded: a model without images, more than the limit, or a prompt their rows would take
        past the context length. With --enable-mm-embeds and a limit of 0, as documented,
        embeddings do not count against it."""
        vision = self.info.vision
        if vision is None:
            raise InvalidRequestError(f"the model {self.model_name!r} does not accept images", param="messages")
        counted = self.counted_images(count, embeds)
        if counted > self.image_limit:
            raise InvalidRequestError(
                f"at most {self.image_limit} image(s) per prompt (--limit-mm-per-prompt), got {counted}",
                param="messages",
            )
        check_context_length(
            len(prompt_ids) + count * max(vision.tokens_per_image - 1, 0), max_tokens, self.info.max_model_len
        )
        return vision

    def counted_images(self, count: int, embeds: int) -> int:
        """Of `count` images, `embeds` given as feature rows, how many count against the image
        limit: all, except that with --enable-mm-embeds and a limit of 0, as documented, the
        embeddings do not."""
        return count - embeds if self.image_limit == 0 and self.config.enable_mm_embeds else count

    async def add_images(self, prompt_ids: Sequence[int], images: Sequence[Any]) -> tuple[list[int], list[ImageInput]]:
        """The prompt with its image tokens (one per image, as a chat template renders them)
        expanded for the model, and the images (RGB `PIL.Image`s, in prompt order) preprocessed
        and placed on them: what `generate` and `stream` take. Preprocessing runs in a thread.
        With --enable-mm-embeds an image may be given as its feature rows instead
        (`sonar.engine.image_embeds`)."""
        from sonar.engine.image_embeds import is_image_embeds, library_embeds
        from sonar.multimodal.processor import ImageEmbeds, Processed, expand_images

        done = {i for i, item in enumerate(images) if isinstance(item, Processed)}
        given = [i for i, item in enumerate(images) if isinstance(item, ImageEmbeds) or is_image_embeds(item)]
        items = [item.value if isinstance(item, Processed) else item for item in images]
        vision = self.check_images(prompt_ids, len(items), embeds=len(given))
        if given and not self.config.enable_mm_embeds:
            raise InvalidRequestError(
                "images given as embeddings need a server started with --enable-mm-embeds", param="image_embeds"
            )
        for i in given:
            if not isinstance(items[i], ImageEmbeds):
                items[i] = library_embeds(items[i], self._feature_width(), self.info.max_model_len, f"images[{i}]")
        pictures = [i for i in range(len(items)) if i not in given and i not in done]
        if pictures:
            processor = await self._processor(vision)
            pixels = await anyio.to_thread.run_sync(lambda: [processor.pixels(items[i]) for i in pictures])
            for i, px in zip(pictures, pixels, strict=True):
                items[i] = px
        return expand_images(prompt_ids, vision, items)

    async def prepare_image(self, data: bytes, decode: Callable[[bytes], Any]) -> Any:
        """A picture's encoded bytes, decoded (`decode`, blocking) and preprocessed in a thread, as
        `add_images` takes it; a picture whose bytes were seen before comes from the cache
        (--mm-processor-cache-gb) without either step."""
        from sonar.multimodal.cache import processed_bytes
        from sonar.multimodal.processor import Processed

        vision = self.info.vision
        if vision is None:
            raise InvalidRequestError(f"the model {self.model_name!r} does not accept images", param="messages")
        key = self.processed_images.key(data)
        value = self.processed_images.get(key)
        if value is None:
            processor = await self._processor(vision)
            value = await anyio.to_thread.run_sync(lambda: processor.pixels(decode(data)))
            self.processed_images.put(key, value, processed_bytes(value))
        return Processed(value)

    def read_image_embeds(self, value: Any, param: str) -> Any:
        """An ``image_embeds`` content part's value as `ImageEmbeds` (a 400 without
        --enable-mm-embeds, or naming what is wrong with it)."""
        from sonar.engine.image_embeds import part_embeds

        if not self.config.enable_mm_embeds:
            raise InvalidRequestError(
                "content part type 'image_embeds' needs a server started with --enable-mm-embeds", param=param
            )
        return part_embeds(value, self._feature_width(), self.info.max_model_len, param)

    def _feature_width(self) -> int:
        """Columns of an image's feature row on this model (`VisionInfo.feature_width`)."""
        vision = self.info.vision
        return (vision.feature_width if vision is not None else 0) or self.info.hidden_size

    async def _processor(self, vision: VisionInfo) -> Any:
        """The image processor, made on first use (it reads the model's preprocessor config)."""
        if self._image_processor is None:
            from sonar.multimodal.processor import image_processor

            path = self.config.tokenizer or self.info.tokenizer_path
            self._image_processor = await anyio.to_thread.run_sync(
                image_processor, vision, path, self.config.mm_processor_kwargs
            )
        return self._image_processor

    async def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The token ids of `text` (in a worker thread), after the prompt-length limit."""
        self.check_prompt_chars(text, "prompt")
        return await anyio.to_thread.run_sync(
            lambda: list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
        )

    def check_prompt_chars(self, text: str, param: str = "prompt") -> None:
        """Refuse a text longer than `max_prompt_chars` (before it costs a tokenization)."""
        limit = self.config.max_prompt_chars
        if len(text) > limit:
            raise InvalidRequestError(
                over_limit("prompt characters", limit, len(text), "max_prompt_chars"), param=param
            )

    def check_token_ids(self, token_ids: Sequence[int], param: str = "prompt") -> None:
        """Refuse a token id outside the model's vocabulary (the one place this is checked)."""
        vocab = self.info.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param=param)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of `token_ids` (in a worker thread), after the vocabulary check."""
        self.check_token_ids(token_ids, "tokens")
        return await anyio.to_thread.run_sync(lambda: self.tokenizer.decode(list(token_ids)))

    def check_completions(self, num_prompts: int, params: SamplingParams) -> None:
        """Refuse a call that asks for more completions (prompts x n) than
        `max_completions_per_request`, before any of its prompts starts."""
        limit, asked = self.config.max_completions_per_request, num_prompts * params.n
        if asked > limit:
            raise InvalidRequestError(
                over_limit("completions (prompts x n)", limit, asked, "max_completions_per_request"),
                param="n" if num_prompts == 1 else "prompt",
            )

    async def abort_all(self) -> list[str]:
        """End every request in flight with finish_reason "abort" (what has been generated so far
        is kept: `generate` returns it, `stream` yields a last delta) and free their blocks.
        Returns the engine request ids."""
        ids = sorted(self._streams)
        by_replica: dict[int, list[str]] = {}
        for rid in ids:
            stream = self._streams.get(rid)
            if stream is not None:
                stream.send_nowait(OutputDelta(rid, "", [], finish_reason="abort"))
            by_replica.setdefault(self._routes.get(rid, 0), []).append(rid)
        for index, replica_ids in sorted(by_replica.items()):
            try:
                await self._scheduler(index).send(Abort(replica_ids))
            except (ActorError, ActorNotFound):
                if self.replicas.count == 1:
                    raise
        return ids

    async def stats(self) -> SchedulerStats:
        """The scheduler's stats; with data parallelism, summed over the replicas that answer
        (KV usage: their mean)."""
        if self.replicas.count == 1:
            return await self._scheduler(0).ask(GetStats(), timeout=10)
        answered = [s for s in await self.replica_stats() if s is not None]
        if not answered:
            raise EngineDeadError(self.dead or "no engine replica answers")
        return _sum_stats(answered)

    async def replica_stats(self, timeout: float = 10.0) -> list[SchedulerStats | None]:
        """Each replica's scheduler stats, in replica order (None: that replica did not answer)."""
        out: list[SchedulerStats | None] = [None] * self.replicas.count

        async def one(index: int) -> None:
            try:
                with anyio.fail_after(timeout):
                    out[index] = await self._scheduler(index).ask(GetStats())
            except (ActorError, ActorNotFound, AskTimeout, TimeoutError):
                return
            if self.router is not None:
                self.router.set_kv_usage(index, out[index].kv_usage)

        async with anyio.create_task_group() as tg:
            for index in range(self.replicas.count):
                tg.start_soon(one, index)
        return out

    def tree(self) -> ActorInfo:
        """The live supervision tree: the whole server's when the engine runs under a root
        supervisor (`sonar serve`), else the engine's."""
        return (self.root or self.supervisor).tree()

    async def tracked_requests(self, timeout: float = 5.0) -> dict[str, int]:
        """How many requests each part holds state for: this frontend, the scheduler, the
        detokenizer (all zero when nothing runs: anything else is a leak)."""
        counts = {"frontend": len(self._streams), "scheduler": 0, "detokenizer": 0}
        with anyio.fail_after(timeout):
            for index in range(self.replicas.count):
                engine = self.replicas.engine(index)
                for actor in ("scheduler", "detokenizer"):
                    counts[actor] += await engine.child(actor).ref.ask(CountRequests())
        return counts

    async def ping(self, timeout: float = 5.0) -> None:
        """One round trip through the scheduler's and the worker's mailboxes, or an exception; with
        data parallelism, of at least one replica (the others may be restarting)."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if self.replicas.count == 1:
            with anyio.fail_after(timeout):
                await self._ping_replica(0)
            return
        answered: list[int] = []
        errors: list[BaseException] = []

        async def one(index: int) -> None:
            try:
                await self._ping_replica(index)
            except Exception as exc:
                errors.append(exc)
                return
            answered.append(index)
            tg.cancel_scope.cancel()

        with anyio.fail_after(timeout):
            async with anyio.create_task_group() as tg:
                for index in range(self.replicas.count):
                    tg.start_soon(one, index)
        if not answered:
            raise EngineDeadError(f"no engine replica answers ({errors[0] if errors else 'none'})")

    async def _ping_replica(self, index: int) -> None:
        engine = self.replicas.engine(index)
        await engine.child("scheduler").ref.ask(GetStats())
        await worker_ref(engine).ask(DescribeWorker())

    def move_replica(self, index: int, reason: str) -> None:
        """Move the requests in flight on replica `index` (lost: `reason`) to a replica that serves
        now, or end them with `EngineDeadError` when none does (`sonar.engine.replay`)."""
        marked: set[int] = set()
        for cid, stream in list(self._streams.items()):
            if self._routes.get(cid, 0) == index and id(stream) not in marked:
                marked.add(id(stream))  # a request's completions share one stream
                stream.send_nowait(Moved(index, reason))

    def fail_replica(self, index: int | None, reason: str) -> None:
        """End the requests in flight on replica `index` (None: on every replica) with an error."""
        for cid, stream in list(self._streams.items()):
            if index is None or self._routes.get(cid, 0) == index:
                stream.send_nowait(Failed(reason))

    # -- sleep mode and profiling -----------------------------------------------------------
    async def sleep(self, level: int = 1, *, drain_timeout: float = SLEEP_DRAIN_TIMEOUT) -> SleepState:
        """Put the engine to sleep (``enable_sleep_mode``; `sonar.core.sleep`): new requests are
        refused (`EngineSleepingError`) from now on, the running ones get up to `drain_timeout`
        seconds to finish, then the KV cache is freed and the weights moved to host memory
        (level 1) or dropped (level 2). `SleepRefusedError` when requests still ran at the
        timeout (the engine then stays awake) or it sleeps at another level already."""
        self._sleep_mode()
        level = check_level(level)
        if not 0 < drain_timeout <= MAX_SLEEP_DRAIN_TIMEOUT:
            raise InvalidRequestError(
                f"drain timeout must be in (0, {MAX_SLEEP_DRAIN_TIMEOUT:g}] seconds, got {drain_timeout!r}",
                param="timeout",
            )
        done: list[int] = []
        for index in range(self.replicas.count):
            msg = SleepEngine(level, drain_timeout)
            reply = await self._ask_sleep(index, msg, drain_timeout + self.config.step_timeout + ASK_MARGIN)
            if reply.refused is not None:
                for woken in done:  # all replicas sleep, or none
                    await self._ask_sleep(woken, WakeEngine(list(check_tags(None))), self._wake_timeout)
                raise SleepRefusedError(reply.refused)
            done.append(index)
        return reply.state

    async def wake_up(self, tags: Sequence[str] | None = None) -> SleepState:
        """Wake what `tags` name (``weights``, ``kv_cache``; None: both) of a sleeping engine;
        it takes requests again once nothing sleeps. Waking what is awake changes nothing."""
        self._sleep_mode()
        wanted = list(check_tags(tags))
        for index in range(self.replicas.count):
            reply = await self._ask_sleep(index, WakeEngine(wanted), self._wake_timeout)
            if reply.refused is not None:
                raise SleepRefusedError(reply.refused)
        return reply.state

    async def sleep_state(self) -> SleepState:
        """What sleeps now (`SleepState.is_sleeping`)."""
        self._sleep_mode()
        return (await self._ask_sleep(0, GetSleepState(), 10.0)).state

    async def is_sleeping(self) -> bool:
        return (await self.sleep_state()).is_sleeping

    async def start_profile(self) -> None:
        """Start torch's profiler in every worker (``profiler_config``; `sonar.engine.profiler`)."""
        await self._ask_workers(StartProfile())

    async def stop_profile(self) -> list[str]:
        """Stop the profiler; the files written (one Chrome trace per worker, and its table)."""
        return await self._ask_workers(StopProfile())

    @property
    def _wake_timeout(self) -> float:
        """The scheduler waits `step_timeout` for the worker to wake (a level 2 wake-up loads
        the model again): this handle waits a little longer for the scheduler's answer."""
        return self.config.step_timeout + ASK_MARGIN

    def _sleep_mode(self) -> None:
        self._check_open()
        if not self.config.enable_sleep_mode:
            raise NotEnabledError("sleep mode is off: start the engine with enable_sleep_mode (--enable-sleep-mode)")

    async def _ask_sleep(self, index: int, msg: Any, timeout: float) -> SleepReply:
        try:
            return await self._scheduler(index).ask(msg, timeout=timeout)
        except (ActorError, ActorNotFound, AskTimeout) as exc:
            raise EngineDeadError(self.dead or f"the scheduler is not available: {exc}") from None

    async def _ask_workers(self, msg: Any) -> list[str]:
        self._check_open()
        if self.config.profiler() is None:
            raise NotEnabledError(
                "profiling is off: start the engine with --profiler-config (profiler torch, torch_profiler_dir DIR)"
            )
        traces: list[str] = []
        for index in range(self.replicas.count):
            try:
                status = await worker_ref(self.replicas.engine(index)).ask(msg, timeout=self.config.step_timeout)
            except (ActorError, ActorNotFound, AskTimeout) as exc:
                raise EngineDeadError(self.dead or f"the worker is not available: {exc}") from None
            traces += status.traces
        return traces

    # -- weight updates ---------------------------------------------------------------------
    def weight_transfer(self) -> WeightTransferConfig:
        """The engine's ``weight_transfer_config``; `NotEnabledError` when weight updates are off."""
        self._check_open()
        config = self.config.weight_transfer()
        if config is None:
            raise NotEnabledError(
                "weight updates are off: start the engine with weight_transfer_config (--weight-transfer-config "
                '\'{"backend": "sonar"}\')'
            )
        return config

    async def update_weights(
        self, path: str | os.PathLike[str] | None = None, *, tensors: Mapping[str, Any] | None = None
    ) -> WeightsUpdated:
        """Write new weights into the running engine (``weight_transfer_config``;
        `sonar.engine.weights`): the safetensors checkpoint folder at `path` (a whole model of the
        same architecture and shapes), or `tensors` (checkpoint name -> tensor in the served
        dtype; any subset, at most ``max_update_bytes`` per call). They apply between steps:
        running requests go on with the new weights, the prefix cache is dropped. An update that
        does not fit raises `WeightUpdateError` and changes nothing. Every replica is updated."""
        config = self.weight_transfer()
        if (path is None) == (tensors is None):
            raise InvalidRequestError("update_weights takes a checkpoint path or tensors, one of the two", param="path")
        sent: dict[str, Any] | None = None
        if tensors is not None:
            sent = _tensors_to_send(tensors, config.max_update_bytes)
        folder = None if path is None else os.path.abspath(os.fspath(path))
        updated: WeightsUpdated | None = None
        for index in range(self.replicas.count):
            try:
                reply: WeightUpdateReply = await self._scheduler(index).ask(
                    UpdateEngineWeights(folder, sent), timeout=self.config.step_timeout + ASK_MARGIN
                )
            except (ActorError, ActorNotFound, AskTimeout) as exc:
                raise EngineDeadError(self.dead or f"the scheduler is not available: {exc}") from None
            if reply.refused is not None:
                raise (WeightUpdateConflictError if reply.conflict else WeightUpdateError)(reply.refused)
            if reply.failed is not None:
                raise EngineDeadError(reply.failed)
            updated = reply.updated
        assert updated is not None
        return updated

    # -- LoRA adapters ----------------------------------------------------------------------
    async def load_lora(
        self, name: str, path: str, base_model_name: str | None = None, *, replace: bool = False
    ) -> LoRARequest:
        """Serve the PEFT adapter in folder `path` as `name` (read and checked first: a bad
        adapter raises `LoRAError` and changes nothing; `replace`: in place of the adapter of
        that name, requests running with the old one finish with it). Needs ``enable_lora``."""
        loras = self._loras("load_lora")
        return await loras.load(name, path, base_model_name or self.model_name, replace=replace)

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter `name` (requests running with it finish with it); `LoRANotFoundError`
        if no adapter has that name."""
        loras = self._loras("unload_lora")
        try:
            loras.unload(name)
        except KeyError:
            raise LoRANotFoundError(f"no LoRA adapter named {name!r} is loaded") from None

    def loras(self) -> list[ServedAdapter]:
        """The adapters served, in the order they were loaded."""
        return [] if self.lora_registry is None else self.lora_registry.served()

    def has_model(self, name: str) -> bool:
        """Whether `name` is a loaded LoRA adapter."""
        return self.lora_registry is not None and self.lora_registry.get(name) is not None

    def _loras(self, what: str) -> LoRARegistry:
        if self.lora_registry is None:
            raise LoRAError(f"{what}: LoRA adapters are off; start the engine with enable_lora (--enable-lora)")
        return self.lora_registry

    def _adapter(self, name: str | None) -> LoRARequest | None:
        if name is None:
            return None
        adapter = None if self.lora_registry is None else self.lora_registry.get(name)
        if adapter is None:
            raise LoRANotFoundError(f"no LoRA adapter named {name!r} is loaded")
        return adapter

    # -- internals --------------------------------------------------------------------------
    def _new_id(self) -> str:
        return f"req-{self._prefix}-{next(self._ids)}"

    def _scheduler(self, index: int) -> Any:
        return self.replicas.engine(index).child("scheduler").ref

    def _route(
        self,
        prompt_ids: list[int],
        cache_salt: str | None,
        lora: LoRARequest | None,
        requests: int,
        images: Sequence[ImageInput] = (),
        avoid: int | None = None,
    ) -> int:
        """The replica for a request (0 without data parallelism), counted in flight there;
        `avoid`: a lost replica the request moves off (`Router.route`)."""
        if self.router is None:
            return 0
        key = None if lora is None else lora.digest
        media = [(im.offset, im.length, im.hash) for im in images]
        switch = self.info.longrope_switch  # a prompt past it is cached under LongRoPE's long factors
        long_rope = switch is not None and len(prompt_ids) > switch
        hashes = self._hasher.chain(prompt_ids, cache_salt, key, media, long_rope) if self._hasher is not None else []
        index = self.router.route(hashes, requests, avoid)
        if index is None and avoid is not None:
            raise EngineDeadError(
                self.dead
                or f"replica {avoid} was lost and no other replica serves now to take its request over; try again later"
            )
        if index is None:
            raise EngineDeadError(self.dead or "every engine replica is restarting; try again later")
        return index

    def _check_open(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if self._closed:
            raise EngineDeadError("the engine is shut down")

    def _check_processor_args(self, params: SamplingParams) -> None:
        """`extra_args` go to the --logits-processors, which may refuse them (`validate_params`)."""
        names = self.config.logits_processors
        if not names:
            if params.extra_args is not None:
                raise InvalidRequestError(
                    "extra_args (vllm_xargs in an HTTP request) are read only by logits processors, and this "
                    "server loads none (--logits-processors)",
                    param="vllm_xargs",
                )
            return
        if self._processor_classes is None:
            self._processor_classes = load_classes(names)
        try:
            validate_params(self._processor_classes, params)
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"vllm_xargs: {exc}", param="vllm_xargs") from None

    async def _prepare(self, prompt: Prompt, params: SamplingParams) -> tuple[list[int], str | None, bytes | None]:
        """The prompt's token ids (placeholders for an embeddings prompt), its text (when given as
        text) and its embeddings as float32 bytes (for an embeddings prompt)."""
        self._check_open()
        if self.info.pooling is not None:
            raise InvalidRequestError(
                "this model is served as a pooling model (embeddings, classification, scores): it generates no "
                "text (a causal LM generates when served without --runner pooling and --convert)",
                param="model",
            )
        config = self.config
        try:
            params.validate(
                max_logprobs=config.max_logprobs,
                vocab_size=self.info.vocab_size,
                max_stop_strings=config.max_stop_strings,
                max_stop_string_chars=config.max_stop_string_chars,
                max_stop_token_ids=config.max_stop_token_ids,
                max_logit_bias=config.max_logit_bias,
            )
            params.check_token_left(vocab_size=self.info.vocab_size, eos_token_ids=self.info.eos_token_ids)
        except SamplingParamsError as exc:
            raise InvalidRequestError(str(exc), param=exc.param) from None
        if params.structured_outputs is not None:
            await self._check_structured(params)
        self._check_processor_args(params)
        self.check_completions(1, params)
        embeds = None
        if is_embeds_prompt(prompt):
            text, embeds = None, self._prompt_embeds(prompt, params)
            ids = [PLACEHOLDER] * (len(embeds) // (4 * self.info.hidden_size))
        elif isinstance(prompt, str):
            text = prompt
            ids = await self.tokenize(prompt)
        else:
            text = None
            ids = [int(t) for t in prompt]
            self.check_token_ids(ids)
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        check_context_length(len(ids), params.max_tokens, self.info.max_model_len)
        return list(ids), text, embeds

    def _prompt_embeds(self, prompt: Mapping[str, Any], params: SamplingParams) -> bytes:
        """An embeddings prompt's float32 bytes, or a 400 (`sonar.engine.prompt_embeds`)."""
        if not self.config.enable_prompt_embeds:
            raise InvalidRequestError(
                "prompt_embeds: prompts given as embeddings need a server started with --enable-prompt-embeds",
                param="prompt_embeds",
            )
        if params.prompt_logprobs is not None:
            raise InvalidRequestError(
                "prompt logprobs (echo with logprobs) need the prompt's tokens, which an embeddings prompt does not "
                "have",
                param="prompt_logprobs",
            )
        embeds = check_prompt_embeds(prompt, self.info.hidden_size, self.info.max_model_len)
        return embeds.numpy().tobytes()

    async def _check_structured(self, params: SamplingParams) -> None:
        """Compile the request's grammar (cached) so a bad spec is refused before admission, and
        refuse what cannot work with it."""
        for name in ("ignore_eos", "min_tokens"):
            if getattr(params, name):
                raise InvalidRequestError(
                    f"{name} cannot be combined with structured_outputs: the grammar decides where the output "
                    f"ends (its stop token){'' if name == 'ignore_eos' else ', and blocking it may leave no token'}",
                    param=name,
                )
        config, info = self.config, self.info
        path = config.tokenizer or info.tokenizer_path
        if path is None:
            raise InvalidRequestError("structured outputs need the model's tokenizer", param="structured_outputs")
        compiler = compiler_for(path, info.vocab_size, info.eos_token_ids, tokenizer=self.tokenizer)
        await compiler.compile(
            params.structured_outputs,
            config.structured_config(),
            max_chars=config.max_structured_output_chars,
            timeout=config.structured_outputs_compile_timeout,
        )

    async def _run(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        priority: int,
        cache_salt: str | None,
        lora: LoRARequest | None = None,
        pooling: PoolingParams | None = None,
        images: Sequence[ImageInput] = (),
        prompt_embeds: bytes | None = None,
        streamed: bool = True,
    ) -> AsyncIterator[StreamDelta]:
        """Submit the request (n completions as n engine requests) and yield their deltas.
        `streamed`: its deltas are shown as they come (False: `generate` shows the sum at the end)."""
        problem = cache_salt_problem(cache_salt)
        if problem is not None:
            raise InvalidRequestError(problem, param="cache_salt")
        if prompt_embeds is not None:  # the prefix cache keys these placeholders by the embeddings
            cache_salt = embeds_salt(prompt_embeds, cache_salt)
        counted = self.counted_images(len(images), sum(im.embeds for im in images)) if images else 0
        if counted > self.image_limit:  # with a limit of 0 the worker has no tower to run
            raise InvalidRequestError(
                f"at most {self.image_limit} image(s) per prompt (--limit-mm-per-prompt), got {counted}",
                param="images",
            )
        children = [params] if params.n == 1 else [params.for_child(i) for i in range(params.n)]
        # The prompt is scored once: only the first completion asks for its logprobs.
        children[1:] = [msgspec.structs.replace(c, prompt_logprobs=None) for c in children[1:]]
        ids = [rid] if params.n == 1 else [f"{rid}-{i}" for i in range(params.n)]
        index = {cid: i for i, cid in enumerate(ids)}
        replica = self._route(prompt_ids, cache_salt, lora, len(ids), images)
        stream = DeltaStream()
        for cid in ids:
            self._streams[cid] = stream
            self._routes[cid] = replica
        pending = set(ids)
        live = {cid: cid for cid in ids}  # the engine id each completion runs under now -> its id
        replays = {cid: Replay() for cid in ids}

        def add_request(eid: str, child: SamplingParams) -> AddRequest:
            return AddRequest(
                request_id=eid,
                prompt_token_ids=prompt_ids,
                params=child,
                sink=self._client,
                priority=priority,
                cache_salt=cache_salt,
                arrival_time=time.monotonic(),
                lora=lora,
                pooling=pooling,
                images=list(images),
                prompt_embeds=prompt_embeds,
                stream=streamed,
            )

        try:
            scheduler = self._scheduler(replica)
            for cid, child in zip(ids, children):
                await self._add(scheduler, add_request(cid, child))
            while pending:
                item = await stream.receive()
                if isinstance(item, Moved):
                    if item.replica != replica:
                        continue  # a mark from a replica this request left already
                    moving = {eid: cid for eid, cid in live.items() if cid in pending}
                    with anyio.CancelScope(shield=True):
                        try:  # the lost replica forgets them, if its scheduler still runs
                            await scheduler.send(Abort(sorted(moving)))
                        except Exception:
                            pass
                    for eid in moving:
                        live.pop(eid)
                        self._streams.pop(eid, None)
                        self._routes.pop(eid, None)
                    assert self.router is not None, "only replicas move"
                    lost = replica
                    replica = self._route(prompt_ids, cache_salt, lora, len(ids), images, avoid=lost)
                    self.router.finished(lost, len(ids))
                    scheduler = self._scheduler(replica)
                    self._moves += 1
                    log.warning("frontend.request_moved", request=rid, lost=lost, replica=replica, reason=item.reason)
                    for cid in sorted(moving.values()):
                        eid = f"{cid}-moved{self._moves}"
                        live[eid] = cid
                        self._streams[eid] = stream
                        self._routes[eid] = replica
                        replays[cid].restart()
                        await self._add(scheduler, add_request(eid, children[index[cid]]))
                    continue
                if isinstance(item, Failed):
                    raise EngineDeadError(item.reason)
                delta: OutputDelta = item
                cid = live.get(delta.req_id)
                if cid is None:
                    continue  # from a replica this completion left
                if delta.error is not None:
                    pending.discard(cid)  # the engine holds nothing more of it
                    raise _request_error(delta.error)
                taken = replays[cid].take(delta)
                if taken is None:
                    continue  # a replay's repeat of what the client has
                delta = taken
                if delta.finish_reason is not None:
                    pending.discard(cid)
                yield StreamDelta(
                    rid,
                    index[cid],
                    delta.text,
                    delta.token_ids,
                    delta.finish_reason,
                    delta.stop_reason,
                    delta.logprobs,
                    delta.prompt_logprobs,
                    delta.num_prompt_tokens,
                    delta.num_cached_tokens,
                    delta.pooled,
                    delta.timing,
                    delta.model_time,
                )
        finally:
            for eid in [*ids, *live]:
                self._streams.pop(eid, None)
                self._routes.pop(eid, None)
            if self.router is not None:
                self.router.finished(replica, len(ids))
            if pending:  # cancelled, failed, or the caller stopped iterating: free the engine's work
                with anyio.CancelScope(shield=True):
                    try:
                        await scheduler.send(Abort(sorted(eid for eid, cid in live.items() if cid in pending)))
                    except Exception:
                        pass

    async def _add(self, scheduler: Any, msg: AddRequest) -> None:
        """Hand one engine request to the scheduler, or raise why it was refused."""
        try:
            accepted = await scheduler.ask(msg, timeout=ADD_TIMEOUT)
        except AskTimeout:
            if self.dead is not None:
                raise EngineDeadError(self.dead) from None
            raise ServerOverloadedError(
                f"the scheduler did not take the request within {ADD_TIMEOUT:g} s; try again later",
                retry_after=RETRY_AFTER,
            ) from None
        except (ActorError, ActorNotFound) as exc:
            raise EngineDeadError(self.dead or f"the scheduler is not available: {exc}") from None
        if accepted.rejected is not None:
            raise accepted.rejected.error(retry_after=RETRY_AFTER)


def check_context_length(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """Refuse a prompt longer than the model's context, in OpenAI's words and with its code
    `context_length_exceeded` (clients such as litellm key on them). A prompt that fits is
    served even when `max_tokens` reaches past the context: generation then stops at its end."""
    if prompt_tokens > max_model_len:
        completion = max_tokens or 0
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + completion} tokens ({prompt_tokens} in the messages, {completion} in the completion). "
            "Please reduce the length of the messages or completion.",
            param="prompt",
            code="context_length_exceeded",
        )


def _sum_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """The stats of several replicas as one engine's: counts summed (per-position counts position
    by position), KV usage their mean (the replicas' caches are the same size)."""
    lists = {"spec_accepted_per_position", "running_loras", "waiting_loras", "kv_residency", "mfu"}
    total = SchedulerStats(
        **{f: sum(getattr(s, f) for s in stats) for f in SchedulerStats.__struct_fields__ if f not in lists},
        spec_accepted_per_position=[
            sum(column) for column in itertools.zip_longest(*(s.spec_accepted_per_position for s in stats), fillvalue=0)
        ],
        running_loras=sorted({name for s in stats for name in s.running_loras}),
        waiting_loras=sorted({name for s in stats for name in s.waiting_loras}),
    )
    residency = [s.kv_residency for s in stats if s.kv_residency is not None]
    total.kv_residency = KVResidencyStats.summed(residency) if residency else None
    mfu = [s.mfu for s in stats if s.mfu is not None]
    total.mfu = MFUStats.summed(mfu) if mfu else None
    total.kv_usage = total.kv_usage / len(stats)
    return total


def _request_error(error: RequestError) -> SonarError:
    """The exception a request that failed alone raises at its caller."""
    if error.type == "quarantined":
        return RequestQuarantinedError(error.message)
    if error.type == "lora":
        return LoRAError(error.message)
    return SamplingFailedError(error.message)


def _tensors_to_send(tensors: Mapping[str, Any], max_bytes: int) -> dict[str, Any]:
    """`tensors` as they travel to the worker (contiguous, in host memory), within `max_bytes`."""
    import torch

    sent: dict[str, Any] = {}
    total = 0
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise WeightUpdateError(
                f"update_weights takes tensors by checkpoint name; got {name!r}: {type(tensor).__name__}"
            )
        total += tensor.nbytes
        if total > max_bytes:
            raise WeightUpdateError(
                f"the update holds over {max_bytes} bytes of tensors (max_update_bytes of --weight-transfer-config); "
                "send it in several calls"
            )
        sent[name] = tensor.detach().to("cpu").contiguous()
    return sent
