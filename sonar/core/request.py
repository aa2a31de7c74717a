"""A request as the scheduler sees it: token ids, limits, progress and status."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from sonar.core.grammar import GrammarMatcher
from sonar.core.outputs import RequestError
from sonar.core.prefix import BlockHash, MediaSpan
from sonar.errors import Rejection, RejectKind, SonarError

__all__ = [
    "MAX_CACHE_SALT_LENGTH",
    "DuplicateRequestError",
    "PromptTooLongError",
    "Request",
    "RequestRejectedError",
    "RequestStatus",
    "cache_salt_problem",
]

MAX_CACHE_SALT_LENGTH = 256
"""Characters a ``cache_salt`` may have: enough for a tenant id or a 256-bit random token; the salt
travels in every first block's KV event and offloaded chunk header."""


def cache_salt_problem(cache_salt: object) -> str | None:
    """Why ``cache_salt`` is not acceptable, or None: it must be None or a non-empty string of at
    most ``MAX_CACHE_SALT_LENGTH`` characters."""
    if cache_salt is None:
        return None
    if not isinstance(cache_salt, str):
        return f"cache_salt must be a string, got {type(cache_salt).__name__}"
    if not cache_salt:
        return "cache_salt must be a non-empty string when given"
    if len(cache_salt) > MAX_CACHE_SALT_LENGTH:
        return f"cache_salt may have at most {MAX_CACHE_SALT_LENGTH} characters, got {len(cache_salt)}"
    return None


class LoRARequest(msgspec.Struct, frozen=True, array_like=True):
    """The LoRA adapter a request runs with, as the engine's messages carry it: its served name,
    its folder and its digest (hex SHA-256 over its config and weights files,
    `sonar.lora.adapter.file_digest`): the worker reads the folder when it needs the weights, and
    the digest keys the request's blocks."""

    name: str
    path: str
    digest: str


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    """A stop token (or a stop string found downstream) ended it."""
    FINISHED_LENGTH = 4
    """``max_tokens`` or the model's context length ended it."""
    FINISHED_ABORTED = 5
    WAITING_FOR_KV = 6
    """Admitted, holding blocks, waiting for its prefix to be loaded from the offload tiers."""
    FINISHED_ERROR = 7
    """Failed alone (``Request.error`` says why): no token could be sampled for it, or it was
    quarantined after worker crashes (`sonar.core.quarantine`)."""

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI ``finish_reason`` for a finished status, else None."""
        return _FINISH_REASONS.get(self)


_FINISHED = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    }
)

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class RequestRejectedError(SonarError, ValueError):
    """The scheduler refused a request before queueing it; `kind` says why, as data."""

    status = 400
    kind = RejectKind.INVALID

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"request {request_id!r}: {message}")
        self.request_id = request_id

    def rejection(self) -> Rejection:
        """The refusal as the scheduler answers it (`AddRequest`'s reply)."""
        return Rejection(self.kind, str(self))


class PromptTooLongError(RequestRejectedError):
    """The prompt has more tokens than the model's context length (``--max-model-len``)."""

    kind = RejectKind.TOO_LONG

    def __init__(self, request_id: str, prompt_len: int, max_model_len: int) -> None:
        super().__init__(
            request_id,
            f"prompt has {prompt_len} tokens, more than the maximum model length of {max_model_len} tokens",
        )
        self.prompt_len = prompt_len
        self.max_model_len = max_model_len


class DuplicateRequestError(RequestRejectedError):
    """A request with this id is already queued or running."""

    kind = RejectKind.DUPLICATE

    def __init__(self, request_id: str) -> None:
        super().__init__(request_id, "a request with this id is already in the scheduler")


class Request:
    """Mutable per-request state owned by the scheduler.

    ``all_token_ids`` is the prompt followed by the generated tokens, kept as one list so a
    scheduling step can slice the tokens to compute without concatenating. The sampling
    parameters are opaque here (``sampling_params``); only the limits the scheduler needs
    to finish a request are fields.
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "output_token_ids",
        "all_token_ids",
        "max_tokens",
        "min_tokens",
        "stop_token_ids",
        "priority",
        "arrival_time",
        "cache_salt",
        "lora",
        "media",
        "media_inputs",
        "skip_reading_prefix_cache",
        "sampling_params",
        "pooling_params",
        "grammar",
        "prompt_embeds",
        "streams",
        "status",
        "num_computed_tokens",
        "num_placeholders",
        "spec_token_ids",
        "draft_slots",
        "decode_steps",
        "proposed",
        "spec_misses",
        "spec_skip",
        "num_cached_tokens",
        "num_offloaded_tokens",
        "num_preemptions",
        "block_hashes",
        "stop_reason",
        "error",
        "seq",
        "scheduled_time",
        "long_rope",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: int | None = None,
        min_tokens: int = 0,
        stop_token_ids: Iterable[int] = (),
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        lora: LoRARequest | None = None,
        media: Sequence[MediaSpan] = (),
        media_inputs: Any = None,
        skip_reading_prefix_cache: bool = False,
        sampling_params: Any = None,
        pooling_params: Any = None,
        grammar: GrammarMatcher | None = None,
        prompt_embeds: bytes | None = None,
        streams: bool = True,
    ) -> None:
        if max_tokens is not None and max_tokens < 1:
            raise RequestRejectedError(request_id, f"max_tokens must be >= 1, got {max_tokens}")
        if min_tokens < 0:
            raise RequestRejectedError(request_id, f"min_tokens must be >= 0, got {min_tokens}")
        if not prompt_token_ids:
            raise RequestRejectedError(request_id, "the prompt is empty")
        problem = cache_salt_problem(cache_salt)
        if problem is not None:
            raise RequestRejectedError(request_id, problem)
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(self.prompt_token_ids)
        self.max_tokens = max_tokens
        """Most tokens to generate; None: until a stop token or the model's context length."""
        self.min_tokens = min_tokens
        self.stop_token_ids = frozenset(stop_token_ids)
        """Token ids that finish the request once ``min_tokens`` are out (EOS included)."""
        self.priority = priority
        """Smaller runs earlier under the priority policy."""
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.cache_salt = cache_salt
        """Mixed into the hash of the first block (so into every block's): requests share cached
        blocks, in every tier, only with requests of the same salt."""
        self.lora = lora
        """The LoRA adapter the request runs with (None: the base model): its digest keys the
        request's blocks as the salt does, and a step holds at most ``max_loras`` adapters."""
        self.media = tuple(media)
        """The images among the prompt's tokens: each one's hash keys the blocks that hold its
        placeholder tokens (`sonar.core.prefix`)."""
        self.media_inputs = media_inputs
        """What the worker needs to compute the images' embeddings (opaque here)."""
        self.streams = streams
        """Its tokens are shown as they come (a stream), not only once it ends: the engine hands
        them over in the middle of a multi-step decode (`sonar.engine.scheduler`)."""
        self.skip_reading_prefix_cache = skip_reading_prefix_cache
        """Compute the whole prompt even if its blocks are cached (prompt logprobs need every
        position's logits); its blocks still enter the cache for other requests."""
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params
        """A pooling request's (opaque here too): it ends with its prompt (``max_tokens`` 1, and
        `Scheduler.finish_pooled` when its result is back)."""
        self.grammar = grammar
        #: The prompt as input embeddings (opaque here: the worker reads them); salted into the block
        #: hashes through `cache_salt` by the engine client.
        self.prompt_embeds = prompt_embeds
        """Structured outputs: the matcher of the request's grammar, advanced with every token the
        request keeps (`sonar.core.grammar`); None for free text."""
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        """Tokens whose KV is in the cache (or scheduled to be written by the steps in flight)."""
        self.num_placeholders = 0
        """Tokens the steps in flight will sample for this request, not known yet. With async
        scheduling a step is scheduled before the previous one's tokens are back: the request's
        sequence then runs this many tokens past ``all_token_ids``, and a decode of it feeds
        `PLACEHOLDER_TOKEN`, which the runner replaces with the token it sampled itself."""
        self.spec_token_ids: list[int] = []
        """Speculative decoding: the drafts the step in flight verifies after the request's last
        token (`sonar.core.speculative`); empty otherwise."""
        self.draft_slots: list[int] = []
        """Speculation with async scheduling (`SchedulerConfig.worker_drafts`): per sampling step in
        flight, oldest first, how many draft slots it had; each such step counts ``1 + slots``
        placeholders (as if every draft were kept), given back when its result shows how many were."""
        self.decode_steps = 0
        """Multi-step decode (`SchedulerConfig.decode_steps`): the tokens the step in flight decodes
        for this request back to back, counted as that many placeholders until its result is back
        (0: none in flight)."""
        self.proposed: list[int] = []
        """Drafts the worker's draft model proposed with the request's last step, for its next."""
        self.spec_misses = 0
        """Steps in a row whose drafts were all rejected."""
        self.spec_skip = 0
        """Decode steps to run without drafts before proposing again (after misses)."""
        self.num_cached_tokens = -1
        """Prompt tokens served from the prefix cache at first admission; -1 until admitted."""
        self.num_offloaded_tokens = 0
        """Of ``num_cached_tokens``, those loaded back from the offload tiers."""
        self.num_preemptions = 0
        self.block_hashes: list[BlockHash] = []
        """Hash chain of the full blocks of ``all_token_ids`` (empty if prefix caching is off)."""
        self.stop_reason: int | str | None = None
        """The stop token id or stop string that finished the request, if any."""
        self.error: RequestError | None = None
        """Why a ``FINISHED_ERROR`` request failed."""
        self.seq = -1
        """Order of arrival at the scheduler; breaks every tie."""
        self.scheduled_time: float | None = None
        """When it was first scheduled (`time.monotonic`, as ``arrival_time``); None until then."""
        self.long_rope = False
        """LongRoPE: the sequence is longer than the original context, computed with the long
        factors (`SchedulerConfig.longrope_switch`); it keys the request's blocks as the salt does."""

    @property
    def lora_key(self) -> str | None:
        """The digest of the request's adapter, or None."""
        return None if self.lora is None else self.lora.digest

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, computed={self.num_computed_tokens}/"
            f"{self.num_tokens}, out={self.num_output_tokens}/{self.max_tokens})"
        )
