"""The OpenAI request and response shapes the HTTP server speaks, as msgspec Structs.

Requests are decoded with `decode_request`: nothing is accepted silently. An unknown field, a
wrong type or an out-of-range value raises `RequestError` naming the parameter, which the app
turns into a 400 in the OpenAI error shape. Every field of OpenAI's request schemas (and the vLLM
extensions) is declared: the ones Sonar does not do are in `REFUSED`, and a request that sets one
(to anything but null or a value that asks for what Sonar does anyway) is a 400 naming it. The
table of every field, honoured or refused, is docs/openai_fields.md (a test keeps it and the
structs in step).

Optional sampling fields are `T | None`: a client that sends `"temperature": null` gets the
default, as with the OpenAI API.

Every number carries its range in its type (`msgspec.Meta`), so decoding rejects it (and the
OpenAPI schema, `sonar/http/openapi.py`, states it): integers fit in int64 (`2**70` is a 400, not
an overflow deep in the engine), `n` is at most `MAX_N`. Limits that depend on the engine
(`max_tokens` up to the model length, `logprobs` up to --max-logprobs, token ids inside the
vocabulary, the request limits such as --max-completions-per-request and --max-stop-strings) are
checked once the engine is known, where the request enters it (`sonar.engine.llm.LLM`).
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Any, ClassVar, Mapping, NamedTuple, TypeVar

import msgspec

from sonar.errors import SonarError
from sonar.http.structured import JsonSchemaFormat as JsonSchemaFormat  # re-exported with the request shapes
from sonar.http.structured import ResponseFormat, StructuredOutputsRequest, structured_outputs_params
from sonar.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams

T = TypeVar("T")

#: OpenAI's cap on `top_logprobs` for chat completions.
MAX_TOP_LOGPROBS = 20
#: OpenAI's cap on `n` (completions per prompt).
MAX_N = 128
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

Int64 = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]
NonNegative = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
Positive = Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
NumCompletions = Annotated[int, msgspec.Meta(ge=1, le=MAX_N)]
TopK = Annotated[int, msgspec.Meta(ge=-1, le=INT64_MAX)]
TopLogprobs = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)]
Temperature = Annotated[float, msgspec.Meta(ge=0)]
TopP = Annotated[float, msgspec.Meta(gt=0, le=1)]
MinP = Annotated[float, msgspec.Meta(ge=0, le=1)]
Penalty = Annotated[float, msgspec.Meta(ge=-2, le=2)]
RepetitionPenalty = Annotated[float, msgspec.Meta(gt=0)]
LogitBias = Annotated[float, msgspec.Meta(ge=-100, le=100)]


class RequestError(SonarError, ValueError):
    """A request the server cannot take as sent: `status` (400/404), `param` names the field,
    `code` is OpenAI's error code where clients key on one (e.g. "model_not_found")."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.code = code


# -- requests -------------------------------------------------------------------------------------
class Refusal(NamedTuple):
    """Why Sonar refuses a declared field, and the values that pass because they ask for what
    Sonar does anyway (e.g. `store: false`); null always passes."""

    reason: str
    inert: tuple[Any, ...] = ()


#: The fields Sonar refuses on both /v1/completions and /v1/chat/completions -> why.
_REFUSED: dict[str, Refusal] = {
    "use_beam_search": Refusal("beam search is not implemented", (False,)),
    "length_penalty": Refusal("beam search is not implemented", (1.0,)),
    "truncate_prompt_tokens": Refusal("prompts are never truncated; a prompt too long is a 400"),
    "allowed_token_ids": Refusal("restricting the vocabulary is not implemented (see structured_outputs)"),
    "bad_words": Refusal("banned words are not implemented"),
    "request_id": Refusal("Sonar names each request itself (see --enable-request-id-headers)"),
    "logits_processors": Refusal(
        "a request cannot bring logits processors; the server loads them (--logits-processors)"
    ),
    "return_tokens_as_token_ids": Refusal("it is set for the whole server (--return-tokens-as-token-ids)", (False,)),
    "return_token_ids": Refusal("responses carry no token ids", (False,)),
    "kv_transfer_params": Refusal("KV transfer between servers is not implemented"),
}

#: The fields /v1/completions declares and refuses -> why.
COMPLETION_REFUSED: dict[str, Refusal] = {
    **_REFUSED,
    "prompt_logprobs": Refusal("prompt logprobs come with echo and logprobs"),
    "add_special_tokens": Refusal("the tokenizer always adds its special tokens to a text prompt", (True,)),
}

#: The fields /v1/chat/completions declares and refuses -> why.
CHAT_REFUSED: dict[str, Refusal] = {
    # OpenAI's.
    "audio": Refusal("Sonar generates text only"),
    "modalities": Refusal("Sonar generates text only", (["text"],)),
    "prediction": Refusal("predicted outputs are not implemented"),
    "store": Refusal("Sonar stores no completions", (False,)),
    "metadata": Refusal("Sonar stores no completions to tag"),
    "service_tier": Refusal("Sonar has one service tier"),
    "web_search_options": Refusal("Sonar has no web search"),
    "functions": Refusal("the legacy functions field is not implemented; use tools"),
    "function_call": Refusal("the legacy function_call field is not implemented; use tool_choice"),
    "reasoning_effort": Refusal("the model's reasoning effort cannot be set"),
    "verbosity": Refusal("the model's verbosity cannot be set"),
    "prompt_cache_key": Refusal("the prefix cache needs no key (see cache_salt)"),
    "prompt_cache_retention": Refusal("the prefix cache's retention cannot be set per request"),
    "prompt_cache_options": Refusal("the prefix cache cannot be configured per request"),
    "safety_identifier": Refusal("Sonar does not moderate requests"),
    "moderation": Refusal("Sonar does not moderate requests"),
    # vLLM's.
    **_REFUSED,
    "best_of": Refusal("chat completions draw n choices, no more", (1,)),
    "prompt_logprobs": Refusal("chat responses carry no prompt logprobs"),
    "echo": Refusal("chat completions do not echo the last message", (False,)),
    "add_special_tokens": Refusal("the chat template writes the special tokens itself", (False,)),
    "documents": Refusal("documents for retrieval-augmented templates are not implemented"),
    "chat_template": Refusal("a request cannot bring its own chat template (--chat-template sets the server's)"),
    "mm_processor_kwargs": Refusal(
        "image processing cannot be set per request (--mm-processor-kwargs sets the server's)"
    ),
    "media_io_kwargs": Refusal("image loading cannot be set per request (--media-io-kwargs sets the server's)"),
    "include_reasoning": Refusal("reasoning text cannot be left out", (True,)),
    "thinking_token_budget": Refusal("the model's thinking cannot be bounded"),
}


def check_refused(request: Any) -> None:
    """A `RequestError` naming the first refused field (its struct's `refused`) `request` sets."""
    for name, refusal in type(request).refused.items():
        value = getattr(request, name)
        if value is not None and not any(_same(value, inert) for inert in refusal.inert):
            raise RequestError(f"{name} is not supported: {refusal.reason}", name)


def _same(value: Any, inert: Any) -> bool:
    """JSON equality: a number equals a number of the same value, but never a boolean."""
    if isinstance(value, bool) or isinstance(inert, bool):
        return value is inert
    return value == inert


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None

    def __post_init__(self) -> None:
        if self.continuous_usage_stats:
            raise ValueError("continuous_usage_stats is not supported: usage comes in the last chunk only")


class _Sampling(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The sampling fields completions and chat completions share (OpenAI's and vLLM's extras)."""

    model: str | None = None
    n: NumCompletions | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[TokenId, LogitBias] | None = None
    #: Written in the request log line (--enable-log-requests); refused without it.
    user: str | None = None
    # vLLM's extras.
    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    ignore_eos: bool | None = None
    min_tokens: NonNegative | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    priority: Int64 = 0
    #: Mixed into the prefix-cache hash of the prompt's first block: only requests with the same
    #: salt share cached blocks (checked by the engine: a non-empty string of bounded length).
    cache_salt: str | None = None

    def sampling_fields(self, defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The set sampling fields as `SamplingParams` keyword arguments, over `defaults` (the
        server's generation config: temperature, top_p, ...; its max_tokens is handled apart)."""
        names = (
            "n",
            "temperature",
            "top_p",
            "stop",
            "seed",
            "presence_penalty",
            "frequency_penalty",
            "logit_bias",
            "top_k",
            "min_p",
            "repetition_penalty",
            "ignore_eos",
            "min_tokens",
            "stop_token_ids",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "spaces_between_special_tokens",
        )
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed with stream: true (as OpenAI)", "stream_options")
        fields = {k: v for k, v in (defaults or {}).items() if k in names}
        fields.update({name: getattr(self, name) for name in names if getattr(self, name) is not None})
        if self.vllm_xargs is not None:
            fields["extra_args"] = self.vllm_xargs
        return fields

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class _Structured(_Sampling, kw_only=True):
    """The sampling fields plus the structured-output fields completions and chat completions
    share: OpenAI's `response_format`, vLLM's current `structured_outputs` and its legacy
    `guided_*` fields."""

    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    response_format: ResponseFormat | None = None
    # Declared to be refused (see `_REFUSED`): any type, so that the refusal names the field.
    use_beam_search: Any = None
    length_penalty: Any = None
    truncate_prompt_tokens: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    request_id: Any = None
    logits_processors: Any = None
    return_tokens_as_token_ids: Any = None
    return_token_ids: Any = None
    kv_transfer_params: Any = None
    #: Arguments for the server's --logits-processors (`SamplingParams.extra_args`).
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The constraint the structured-output fields ask for (None: free text)."""
        return structured_outputs_params(
            response_format=self.response_format,
            structured_outputs=self.structured_outputs,
            guided_json=self.guided_json,
            guided_regex=self.guided_regex,
            guided_choice=self.guided_choice,
            guided_grammar=self.guided_grammar,
            guided_decoding_backend=self.guided_decoding_backend,
            guided_whitespace_pattern=self.guided_whitespace_pattern,
        )


class CompletionRequest(_Structured, kw_only=True):
    refused: ClassVar[Mapping[str, Refusal]] = COMPLETION_REFUSED

    # str | list[str] | list[int] | list[list[int]]: msgspec takes one array type per union, so
    # the list is checked by `prompts()`.
    prompt: str | list[Any] | None = None
    #: Absent: 16, or the generation config's max_new_tokens (null: up to the context). 0 only
    #: with `echo`: the prompt is scored, nothing is generated.
    max_tokens: NonNegative | None | msgspec.UnsetType = msgspec.UNSET
    logprobs: NonNegative | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: NumCompletions | None = None
    prompt_logprobs: Any = None
    #: Base64 of a torch-saved tensor [tokens, hidden size] each (--enable-prompt-embeds), in place
    #: of `prompt` (`sonar.engine.prompt_embeds`).
    prompt_embeds: str | list[str] | None = None
    add_special_tokens: Any = None

    @property
    def scores_only(self) -> bool:
        """`echo` with `max_tokens: 0`: score the prompt, generate nothing."""
        return bool(self.echo) and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: each a string or a list of token ids."""
        p = self.prompt
        if p is None:
            raise RequestError("prompt is required (or prompt_embeds, on a server that takes them)", "prompt")
        if isinstance(p, str):
            return [p]
        if not p:
            raise RequestError("prompt must not be empty", "prompt")
        if all(isinstance(x, str) for x in p):
            prompts: list[str | list[int]] = list(p)
        elif all(_is_int(x) for x in p):
            prompts = [list(p)]
        elif all(isinstance(x, list) and x and all(_is_int(t) for t in x) for x in p):
            prompts = [list(x) for x in p]
        else:
            raise RequestError(
                "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids",
                "prompt",
            )
        return prompts

    def check_max_tokens(self, max_model_len: int) -> None:
        check_max_tokens(None if self.max_tokens is msgspec.UNSET else self.max_tokens, max_model_len)

    def sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """`defaults`: the server's generation config (see `sampling_fields`, `default_max_tokens`)."""
        if self.suffix:
            raise RequestError("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise RequestError("best_of is not supported (only best_of == n)", "best_of")
        if self.logprobs is not None and self.logprobs < 0:
            raise RequestError(f"logprobs must be >= 0, got {self.logprobs}", "logprobs")
        if self.max_tokens == 0 and not self.echo:
            raise RequestError("max_tokens must be at least 1 (0 only with echo: the prompt is scored)", "max_tokens")
        fields = self.sampling_fields(defaults)
        max_tokens = default_max_tokens(
            None if self.max_tokens is msgspec.UNSET else self.max_tokens,
            defaults,
            16 if self.max_tokens is msgspec.UNSET else None,
        )
        return make_sampling_params(
            # Scoring runs the prompt and samples one token, which the response leaves out.
            max_tokens=1 if self.scores_only else max_tokens,
            logprobs=self.logprobs,
            prompt_logprobs=self.logprobs if self.echo and self.logprobs is not None else None,
            structured_outputs=self.structured_outputs_params(),
            **fields,
        )


class ImageURL(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """An ``image_url`` part's image: a data:, file:// or http(s):// URL (`sonar.multimodal.media`)."""

    url: str
    detail: str | None = None
    """OpenAI's resolution hint: only "auto" (the model's fixed input size) is served."""


class TextPart(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A content part: "text" parts, and "image_url" parts for a model that takes images (and
    "image_embeds" parts with --enable-mm-embeds: base64 text, or an object of base64 texts); the
    others OpenAI defines are declared so that their refusal names the part's type."""

    type: str
    text: str | None = None
    image_url: ImageURL | None = None
    image_embeds: str | dict[str, str] | None = None
    input_audio: Any = None
    file: Any = None
    refusal: Any = None


class FunctionCall(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A function call as OpenAI writes it: `arguments` is JSON text (not an object)."""

    name: str
    arguments: str


class ToolCall(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One tool call of an assistant message (request) or of a response message."""

    id: str
    function: FunctionCall
    type: str = "function"


class ChatMessage(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One message of a chat request; `sonar.http.messages` checks it and renders it for the template."""

    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    #: An assistant message's tool calls (its content may then be null).
    tool_calls: list[ToolCall] | None = None
    #: A `tool` message answers the call with this id.
    tool_call_id: str | None = None
    #: An assistant message's thinking, as a reasoning parser returned it (vLLM's two names).
    reasoning_content: str | None = None
    reasoning: str | None = None
    # What a response message carries and a client may send back with it: accepted when empty.
    refusal: Any = None
    annotations: Any = None
    audio: Any = None
    function_call: Any = None


class FunctionDefinition(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    description: str | None = None
    #: A JSON schema of the arguments object.
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A tool the model may call (`tools` of a chat request); only functions exist."""

    function: FunctionDefinition
    type: str = "function"


class NamedFunction(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`tool_choice` naming the one function the model must call."""

    function: NamedFunction
    type: str = "function"


class ChatCompletionRequest(_Structured, kw_only=True):
    refused: ClassVar[Mapping[str, Refusal]] = CHAT_REFUSED

    messages: list[ChatMessage]
    tools: list[ChatTool] | None = None
    #: "none", "auto", "required", or a `NamedToolChoice`.
    tool_choice: str | NamedToolChoice | None = None
    #: Only matters when the model calls tools (see `sonar.http.tools.plan_tools`).
    parallel_tool_calls: bool | None = None
    #: Extra variables for the chat template (e.g. `enable_thinking`).
    chat_template_kwargs: dict[str, Any] | None = None
    max_completion_tokens: Positive | None = None
    max_tokens: Positive | None = None
    logprobs: bool | None = False
    top_logprobs: TopLogprobs | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # Declared to be refused (see `CHAT_REFUSED`).
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    safety_identifier: Any = None
    moderation: Any = None
    best_of: Any = None
    prompt_logprobs: Any = None
    echo: Any = None
    add_special_tokens: Any = None
    documents: Any = None
    chat_template: Any = None
    mm_processor_kwargs: Any = None
    media_io_kwargs: Any = None
    include_reasoning: Any = None
    thinking_token_budget: Any = None

    def check_max_tokens(self, max_model_len: int) -> None:
        if self.max_completion_tokens is not None:
            check_max_tokens(self.max_completion_tokens, max_model_len, "max_completion_tokens")
        else:
            check_max_tokens(self.max_tokens, max_model_len)

    def sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """`defaults`: the server's generation config (see `sampling_fields`, `default_max_tokens`)."""
        top = self.top_logprobs
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}", "top_logprobs")
        if top and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs set to true", "top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        param = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        return make_sampling_params(
            max_tokens=default_max_tokens(max_tokens, defaults),
            logprobs=(top or 0) if self.logprobs else None,
            structured_outputs=self.structured_outputs_params(),
            _max_tokens_param=param,
            **self.sampling_fields(defaults),
        )


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    #: With `messages`: rendered by the chat template as a chat request renders them.
    tools: list[ChatTool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: list[TokenId]


class LoadLoRAAdapterRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    lora_name: str
    lora_path: str
    load_inplace: bool = False
    """Replace the adapter already loaded under `lora_name` (else that name is refused)."""


class UnloadLoRAAdapterRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    lora_name: str
    lora_int_id: int | None = None
    """Accepted for vLLM's clients; Sonar names adapters only by `lora_name`, so it must be unset."""


def default_max_tokens(
    given: int | None, defaults: Mapping[str, Any] | None, fallback: int | None = None
) -> int | None:
    """The request's max_tokens under the generation config's `max_tokens` (its max_new_tokens):
    that is the default when the request sets none, and caps what it sets."""
    cap = (defaults or {}).get("max_tokens")
    if given is None:
        return cap if cap is not None else fallback
    return given if cap is None else min(given, cap)


def check_max_tokens(given: int | None, max_model_len: int, param: str = "max_tokens") -> None:
    """A `max_tokens` the client set beyond the model's whole context can never be honoured: a 400
    (as vLLM) rather than a request that runs until the context is full. (A server default above
    it is not the client's fault: generation simply stops at the context length.)"""
    if given is not None and given > max_model_len:
        raise RequestError(f"{param} must be at most the model's context length ({max_model_len}), got {given}", param)


def make_sampling_params(_max_tokens_param: str = "max_tokens", **kwargs: Any) -> SamplingParams:
    """`SamplingParams(**kwargs)`, its range errors as `RequestError`s naming the parameter."""
    try:
        return SamplingParams(**kwargs)
    except SamplingParamsError as exc:
        param = _max_tokens_param if exc.param == "max_tokens" else exc.param
        raise RequestError(str(exc).replace("max_tokens:", f"{param}:", 1), param) from None


_PATH = re.compile(r" - at `(?:key` in `)?\$\.?(.*)`$")


def decode_request(body: bytes, kind: type[T]) -> T:
    """Decode a JSON body into `kind`; malformed JSON, invalid UTF-8 (anywhere in the body),
    nesting too deep, an unknown field, wrong types, a refused field set (`check_refused`) →
    `RequestError` (400)."""
    try:
        if not body.isascii():
            body.decode("utf-8")
        request = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        message = str(exc)
        match = _PATH.search(message)
        param = match.group(1).removesuffix("[...]") if match and match.group(1) else None
        unknown = re.match(r"Object contains unknown field `([^`]*)`", message)
        if unknown:
            name = f"{param}.{unknown.group(1)}" if param else unknown.group(1)
            return _raise(
                RequestError(f"unknown field {name!r}: Sonar does not know it (see docs/openai_fields.md)", name)
            )
        if param is None:  # "Object missing required field `prompt`"
            missing = re.search(r"missing required field `(\w+)`", message)
            param = missing.group(1) if missing else None
        return _raise(RequestError(f"invalid request: {message}", param))
    except msgspec.DecodeError as exc:
        return _raise(RequestError(f"malformed JSON body: {exc}"))
    except UnicodeDecodeError as exc:
        return _raise(RequestError(f"the body is not valid UTF-8: {exc.reason} at byte {exc.start}"))
    except RecursionError:
        return _raise(RequestError("malformed JSON body: nested too deeply"))
    if hasattr(kind, "refused"):
        check_refused(request)
    return request


def _raise(exc: Exception) -> Any:
    raise exc


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# -- responses ------------------------------------------------------------------------------------
class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    #: The HTTP status, or OpenAI's code where clients key on it ("context_length_exceeded",
    #: "model_not_found").
    code: int | str


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


class CompletionLogprobs(msgspec.Struct):
    """The legacy completions logprobs block: parallel lists, one entry per token."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class PerRequestMetrics(msgspec.Struct):
    """--enable-per-request-metrics: a request's timing, as vLLM reports it (None where unknown)."""

    time_to_first_token_ms: float | None = None
    """From its first scheduling to its first token."""
    generation_time_ms: float | None = None
    """From its first token to its last."""
    queue_time_ms: float | None = None
    """From its arrival at the engine to its first scheduling."""
    mean_itl_ms: float | None = None
    tokens_per_second: float | None = None
    """Generated tokens over the time from its first scheduling to its last token."""


class CompletionResponse(msgspec.Struct):
    id: str
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"
    created: int = msgspec.field(default_factory=lambda: int(time.time()))
    system_fingerprint: str | None = None
    metrics: PerRequestMetrics | msgspec.UnsetType = msgspec.UNSET


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[TokenLogprob]


class ResponseMessage(msgspec.Struct, omit_defaults=True):
    """The generated message: `content` is null when the model only called tools; `tool_calls`,
    `reasoning_content` and `reasoning` (the same thinking text, vLLM's newer name) appear when set."""

    role: str
    content: str | None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: ResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(msgspec.Struct):
    id: str
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    created: int = msgspec.field(default_factory=lambda: int(time.time()))
    system_fingerprint: str | None = None
    metrics: PerRequestMetrics | msgspec.UnsetType = msgspec.UNSET


class DeltaFunctionCall(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    """A piece of a streamed tool call: the first carries `id`, `type` and the name; the later
    ones pieces of the arguments, which the client joins by `index`."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    model: str
    choices: list[ChatChunkChoice]
    created: int
    usage: Usage | None = None
    object: str = "chat.completion.chunk"
    system_fingerprint: str | None = None
    metrics: PerRequestMetrics | msgspec.UnsetType = msgspec.UNSET


class ModelCard(msgspec.Struct):
    id: str
    root: str
    max_model_len: int
    object: str = "model"
    created: int = msgspec.field(default_factory=lambda: int(time.time()))
    owned_by: str = "sonar"
    parent: str | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str
