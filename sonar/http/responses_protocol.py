"""The shapes of OpenAI's Responses API (`POST /v1/responses`): the request, the response object and
the streaming events, as msgspec Structs, and the pure mapping from a request to what the engine
takes (chat-template messages, `SamplingParams`).

The request is strict: a field OpenAI defines either takes effect or is refused with a 400 naming
it (`ResponsesRequest.check_refused`); a field OpenAI does not define is refused too. Input items
arrive as JSON objects and are read here one by one (`input_messages`), so that each refusal names
its item (`input[2].content[0].type`). docs/responses_api.md keeps the table of every field.

A conversation is kept as chat-template messages (`{"role", "content"}` dicts, function calls as
`tool_calls` and `tool` messages, the shape transformers' `apply_chat_template` takes):
`previous_response_id` continues the stored conversation of that response with the new input.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, Mapping

import msgspec

from sonar.http.protocol import (
    ChatTool,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    Positive,
    RequestError,
    Temperature,
    TopLogprobs,
    TopP,
    decode_request,
    default_max_tokens,
    make_sampling_params,
)
from sonar.sampling_params import SamplingParams, StructuredOutputsParams

#: OpenAI's limits on `metadata`: 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
#: The `include` value Sonar honours: logprobs on the output text.
INCLUDE_LOGPROBS = "message.output_text.logprobs"
#: Sampling defaults from the generation config that apply to a response (its max_tokens apart).
DEFAULT_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

#: OpenAI request fields Sonar refuses whenever they are set (not null), and why.
REFUSED = {
    "conversation": "conversation objects are not supported; chain responses with previous_response_id",
    "prompt": "prompt templates are not supported; send the input",
    "max_tool_calls": "built-in tools are not supported, so there are no tool calls to count",
    "prompt_cache_key": "prompt caching is automatic (prefix caching); it takes no key",
    "prompt_cache_retention": "the prefix cache keeps blocks while memory allows; its retention cannot be set",
    "prompt_cache_options": "the prefix cache keeps blocks while memory allows; it takes no options",
    "safety_identifier": "there is no usage-policy monitoring to identify users to",
    "context_management": "context management (compaction) is not supported",
    "image": "images go in input_image content parts of the input",
    "moderation": "moderation is not supported",
    "access_programs": "access programs are not supported",
    "background_options": "background responses are not supported",
}


# -- the request ----------------------------------------------------------------------------------
class JsonSchemaTextFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """`text.format` of type json_schema: the schema the output must validate against."""

    type: str
    name: str
    schema: dict[str, Any]
    strict: bool | None = None
    description: str | None = None


class TextFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`text.format` of type text or json_object (json_schema is `JsonSchemaTextFormat`)."""

    type: str


class TextConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    #: Decoded by `text_format()`: its fields depend on its type.
    format: dict[str, Any] | None = None
    verbosity: str | None = None


class FunctionTool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A function tool, in the Responses shape (chat's nests the same fields under `function`)."""

    type: str
    name: str
    parameters: dict[str, Any] | None = None
    #: The arguments of forced calls always follow `parameters`; those of "auto" calls are what
    #: the model wrote (as in chat completions): `strict` changes neither.
    strict: bool | None = None
    description: str | None = None


class ReasoningConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`reasoning`: how much a reasoning model thinks and whether it summarizes. Neither can be
    set here (`check_refused`); all null takes effect as it says (the model's own thinking)."""

    effort: Any = None
    summary: Any = None
    generate_summary: Any = None


class ResponsesStreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_obfuscation: bool | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The body of `POST /v1/responses`. Every field of OpenAI's `ResponseCreateParams` is here:
    those Sonar honours with their types, those it refuses as `Any` (see `REFUSED`)."""

    #: A string (one user message) or a list of input items (read by `input_messages`).
    input: str | list[Any]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: Positive | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_logprobs: TopLogprobs | None = None
    stream: bool | None = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool | None = True
    previous_response_id: str | None = None
    text: TextConfig | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: str | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None
    background: bool | None = None
    service_tier: str | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    safety_identifier: Any = None
    context_management: Any = None
    image: Any = None
    moderation: Any = None
    access_programs: Any = None
    background_options: Any = None

    def check_refused(self) -> None:
        """Refuse, naming it, every field set to something Sonar cannot honour."""
        for name, why in REFUSED.items():
            if getattr(self, name) is not None:
                raise RequestError(f"{name} is not supported: {why}", name)
        for name in ("effort", "summary", "generate_summary"):
            if self.reasoning is not None and getattr(self.reasoning, name) is not None:
                raise RequestError(
                    f"reasoning.{name} is not supported: a model here thinks as its chat template and weights "
                    "make it (--reasoning-parser returns that thinking as a reasoning item), it cannot be "
                    "told how much, nor summarize",
                    f"reasoning.{name}",
                )
        if self.background:
            raise RequestError("background responses are not supported (set background to false)", "background")
        if self.truncation not in (None, "disabled"):
            raise RequestError(
                f"truncation {self.truncation!r} is not supported; only 'disabled' (an input too long for "
                "the model is a 400)",
                "truncation",
            )
        if self.service_tier not in (None, "auto", "default"):
            raise RequestError(
                f"service_tier {self.service_tier!r} is not supported; only 'auto' or 'default'", "service_tier"
            )
        if self.stream_options is not None:
            if not self.stream:
                raise RequestError("stream_options needs stream set to true", "stream_options")
            if self.stream_options.include_obfuscation:
                raise RequestError(
                    "stream obfuscation is not supported (set include_obfuscation to false)",
                    "stream_options.include_obfuscation",
                )
        for include in self.include or ():
            if include != INCLUDE_LOGPROBS:
                raise RequestError(f"include {include!r} is not supported; only {INCLUDE_LOGPROBS!r}", "include")
        if self.top_logprobs is not None and INCLUDE_LOGPROBS not in (self.include or ()):
            raise RequestError(f"top_logprobs needs include [{INCLUDE_LOGPROBS!r}]", "top_logprobs")
        if self.text is not None and self.text.verbosity not in (None, "medium"):
            raise RequestError(
                f"text.verbosity {self.text.verbosity!r} is not supported; only 'medium'", "text.verbosity"
            )
        self._check_metadata()

    def _check_metadata(self) -> None:
        metadata = self.metadata or {}
        if len(metadata) > MAX_METADATA_PAIRS:
            raise RequestError(f"metadata holds at most {MAX_METADATA_PAIRS} pairs, got {len(metadata)}", "metadata")
        for key, value in metadata.items():
            if len(key) > MAX_METADATA_KEY:
                raise RequestError(f"metadata keys are at most {MAX_METADATA_KEY} characters: {key[:80]!r}", "metadata")
            if len(value) > MAX_METADATA_VALUE:
                raise RequestError(
                    f"metadata values are at most {MAX_METADATA_VALUE} characters (key {key!r})", "metadata"
                )

    def chat_tools(self) -> list[ChatTool] | None:
        """`tools` in chat's shape (what `template_tools` and `tool_plan` take); a tool that is not
        a function is a 400 naming it."""
        if self.tools is None:
            return None
        tools = []
        for i, raw in enumerate(self.tools):
            kind = raw.get("type") if isinstance(raw, dict) else None
            if kind != "function":
                raise RequestError(
                    f"tool type {kind!r} is not supported; only 'function' (no built-in tools)", f"tools[{i}].type"
                )
            tool = convert_item(raw, FunctionTool, f"tools[{i}]")
            tools.append(ChatTool(function=FunctionDefinition(**{f: getattr(tool, f) for f in _FUNCTION_FIELDS})))
        return tools

    def chat_tool_choice(self) -> str | NamedToolChoice | None:
        """`tool_choice` in chat's shape: a string as it is, `{"type": "function", "name"}` as a
        named choice; the other kinds (allowed_tools, built-in tools, MCP) are refused."""
        choice = self.tool_choice
        if choice is None or isinstance(choice, str):
            return choice
        if choice.get("type") != "function":
            raise RequestError(
                f"tool_choice type {choice.get('type')!r} is not supported; use 'none', 'auto', 'required' or "
                '{"type": "function", "name": ...}',
                "tool_choice.type",
            )
        named = convert_item(choice, _NamedChoice, "tool_choice")
        return NamedToolChoice(function=NamedFunction(name=named.name))

    def check_max_tokens(self, max_model_len: int) -> None:
        if self.max_output_tokens is not None and self.max_output_tokens > max_model_len:
            raise RequestError(
                f"max_output_tokens must be at most the model's context length ({max_model_len}), "
                f"got {self.max_output_tokens}",
                "max_output_tokens",
            )

    @property
    def logprobs(self) -> int | None:
        """How many top logprobs each output token carries (None: no logprobs)."""
        return (self.top_logprobs or 0) if INCLUDE_LOGPROBS in (self.include or ()) else None

    def sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """`defaults`: the server's generation config (its max_tokens caps max_output_tokens)."""
        fields = {k: v for k, v in (defaults or {}).items() if k in DEFAULT_SAMPLING_KEYS}
        if self.temperature is not None:
            fields["temperature"] = self.temperature
        if self.top_p is not None:
            fields["top_p"] = self.top_p
        return make_sampling_params(
            max_tokens=default_max_tokens(self.max_output_tokens, defaults),
            logprobs=self.logprobs,
            structured_outputs=self.structured_outputs(),
            _max_tokens_param="max_output_tokens",
            **fields,
        )

    def text_format(self) -> JsonSchemaTextFormat | TextFormat:
        """`text.format`, decoded for its type (absent: plain text)."""
        raw = self.text.format if self.text is not None else None
        if raw is None:
            return TextFormat(type="text")
        kind = raw.get("type")
        if kind not in ("text", "json_object", "json_schema"):
            raise RequestError(
                f"text.format type {kind!r} is not supported; use 'text', 'json_object' or 'json_schema'",
                "text.format.type",
            )
        fmt = convert_item(raw, JsonSchemaTextFormat if kind == "json_schema" else TextFormat, "text.format")
        if isinstance(fmt, JsonSchemaTextFormat) and fmt.description is not None:
            raise RequestError(
                "text.format.description is not supported: the server does not show it to the model",
                "text.format.description",
            )
        return fmt

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """`text.format` as the engine's constraint: json_object → any JSON object, json_schema →
        its schema (enforced whether `strict` is set or not), text → none."""
        fmt = self.text_format()
        if isinstance(fmt, JsonSchemaTextFormat):
            return StructuredOutputsParams(json=fmt.schema)
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        return None

    def text_config(self) -> dict[str, Any]:
        """The `text` the response reports: the format as it was asked for."""
        fmt = self.text_format()
        return {"format": msgspec.to_builtins(fmt), "verbosity": "medium"}


_FUNCTION_FIELDS = ("name", "description", "parameters", "strict")


class _NamedChoice(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    name: str


# -- input items → chat-template messages -----------------------------------------------------------
_UNKNOWN_FIELD = re.compile(r"unknown field `([^`]+)`(?: - at `\$\.?(.*)`)?")
_MISSING_FIELD = re.compile(r"missing required field `([^`]+)`(?: - at `\$\.?(.*)`)?")
_AT = re.compile(r" - at `\$\.?(.*)`$")


def convert_item(raw: Any, kind: type[Any], where: str) -> Any:
    """`raw` (a decoded JSON value) as a `kind` Struct; a wrong or unknown field is a 400 naming
    it under `where` (`input[2].call_id`)."""
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as exc:
        message = str(exc)
        unknown = _UNKNOWN_FIELD.search(message)
        if unknown:
            inner = ".".join(p for p in (unknown.group(2), unknown.group(1)) if p)
            raise RequestError(f"{where}.{inner} is not a known field", f"{where}.{inner}") from None
        missing = _MISSING_FIELD.search(message)
        if missing:
            inner = ".".join(p for p in (missing.group(2), missing.group(1)) if p)
            raise RequestError(f"{where}.{inner} is required", f"{where}.{inner}") from None
        at = _AT.search(message)
        param = f"{where}.{at.group(1)}" if at and at.group(1) else where
        raise RequestError(f"invalid {where}: {message}", param) from None


class ContentPart(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """input_text, or output_text (an earlier answer sent back; its annotations and logprobs are
    output-only metadata that the model does not see, as at OpenAI)."""

    type: str
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class ImagePart(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """input_image: an image by URL (data:, file://, http(s)://, as chat's `image_url` parts)."""

    type: str
    image_url: str | None = None
    #: Refused: Sonar has no Files API.
    file_id: str | None = None
    #: Only "auto" (or absent): the model's processor decides the image's size.
    detail: str | None = None


#: The key of a stored user message that holds its images' URLs in order (taken out before the
#: template renders the message): a later turn that continues the conversation sends them again.
IMAGES = "images"


class MessageItem(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    role: str
    content: str | list[Any]
    type: str = "message"
    #: Set on an output message sent back as input: identifies it, changes nothing.
    id: str | None = None
    status: str | None = None


class FunctionCallItem(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    call_id: str
    name: str
    #: The call's arguments as JSON text.
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    call_id: str
    #: The function's result: text, or a list of input_text parts.
    output: str | list[Any]
    id: str | None = None
    status: str | None = None


class ReasoningItem(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A reasoning output item sent back: its text reaches the template as the next assistant
    message's `reasoning_content` (templates decide whether to show it)."""

    type: str
    summary: list[Any]
    content: list[Any] | None = None
    #: Sonar never makes encrypted reasoning; only null is accepted.
    encrypted_content: None = None
    id: str | None = None
    status: str | None = None


#: Input roles and the chat-template role each becomes (`developer` is the system's voice).
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def input_messages(
    input: str | list[Any],
    param: str = "input",
    image_token: str | None = None,
    images: list[tuple[str, str]] | None = None,
) -> list[dict[str, Any]]:
    """The request's `input` as chat-template messages: a string is one user message; a list is
    read item by item (messages, reasoning, function calls and their outputs). What one assistant
    turn produced becomes one assistant message, as a response's output items make it: a reasoning
    item starts it (`reasoning_content`), an assistant message after it gives its content, and
    function_call items after an assistant message join its `tool_calls` (parallel calls).

    With `image_token` (a model that takes images), an `input_image` part of a message other than
    an assistant's becomes that text where the part was, and its URL joins the message's `IMAGES`
    and, with the part's param (``input[0].content[1].image_url``), `images`."""
    if isinstance(input, str):
        return [{"role": "user", "content": input}]
    if not input:
        raise RequestError(f"{param} must not be empty", param)
    messages: list[dict[str, Any]] = []
    for i, raw in enumerate(input):
        where = f"{param}[{i}]"
        if not isinstance(raw, dict):
            raise RequestError(f"{where} must be an object (an input item)", where)
        kind = raw.get("type", "message" if "role" in raw else None)
        last = messages[-1] if messages else None
        if kind == "message":
            message = _message(convert_item(raw, MessageItem, where), where, image_token, images)
            if message["role"] == "assistant" and _only_reasoning(last):
                last["content"] = message["content"]  # type: ignore[index]
            else:
                messages.append(message)
        elif kind == "reasoning":
            item = convert_item(raw, ReasoningItem, where)
            if item.summary:
                raise RequestError(f"{where}.summary must be empty (Sonar makes no summaries)", f"{where}.summary")
            text = _text_of(item.content or [], f"{where}.content", ("reasoning_text",))
            messages.append({"role": "assistant", "content": "", "reasoning_content": text})
        elif kind == "function_call":
            call = convert_item(raw, FunctionCallItem, where)
            tool_call = {
                "id": call.call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": _arguments(call.arguments, f"{where}.arguments")},
            }
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(tool_call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [tool_call]})
        elif kind == "function_call_output":
            out = convert_item(raw, FunctionCallOutputItem, where)
            text = (
                out.output if isinstance(out.output, str) else _text_of(out.output, f"{where}.output", ("input_text",))
            )
            messages.append({"role": "tool", "tool_call_id": out.call_id, "content": text})
        else:
            raise RequestError(
                f"input item type {kind!r} is not supported; use 'message', 'reasoning', 'function_call' or "
                "'function_call_output'",
                f"{where}.type",
            )
    return messages


def _only_reasoning(message: dict[str, Any] | None) -> bool:
    """Whether `message` is an assistant turn that has so far only thought."""
    return (
        message is not None
        and message["role"] == "assistant"
        and "reasoning_content" in message
        and not message["content"]
        and not message.get("tool_calls")
    )


def _message(
    item: MessageItem, where: str, image_token: str | None, images: list[tuple[str, str]] | None
) -> dict[str, Any]:
    if item.role not in ROLES:
        raise RequestError(
            f"role {item.role!r} is not supported; use 'user', 'system', 'developer' or 'assistant'", f"{where}.role"
        )
    if isinstance(item.content, str):
        return {"role": ROLES[item.role], "content": item.content}
    if item.role == "assistant":  # OpenAI's own shapes: an assistant says output_text
        return {"role": "assistant", "content": _text_of(item.content, f"{where}.content", ("output_text",))}
    texts: list[str] = []
    urls: list[str] = []
    for j, raw in enumerate(item.content):
        part = f"{where}.content[{j}]"
        if isinstance(raw, dict) and raw.get("type") == "input_image":
            texts.append(_image(convert_item(raw, ImagePart, part), part, image_token, urls))
            if images is not None:
                images.append((urls[-1], f"{part}.image_url"))
        else:
            texts.append(_text_of([raw], f"{where}.content", ("input_text", "input_image"), first=j))
    message = {"role": ROLES[item.role], "content": "\n".join(texts)}
    if urls:
        message[IMAGES] = urls
    return message


def _image(part: ImagePart, where: str, image_token: str | None, urls: list[str]) -> str:
    """The text an input_image part becomes (the model's image token); its URL joins `urls`."""
    if image_token is None:
        raise RequestError(
            "content part type 'input_image' is not supported: this model does not accept images", f"{where}.type"
        )
    if part.file_id is not None:
        raise RequestError(
            "input_image.file_id is not supported: Sonar has no Files API; send the image as image_url "
            "(a data: URL, or file:// / http(s):// where the server allows them)",
            f"{where}.file_id",
        )
    if part.image_url is None:
        raise RequestError("an 'input_image' part needs its image_url", f"{where}.image_url")
    if part.detail not in (None, "auto"):
        raise RequestError(
            f"input_image.detail {part.detail!r} is not supported (only 'auto': the model's image processor "
            "decides the image's size)",
            f"{where}.detail",
        )
    urls.append(part.image_url)
    return image_token


def _text_of(parts: list[Any], where: str, allowed: tuple[str, ...], first: int = 0) -> str:
    """The text of a list of content parts, joined by newlines (`first`: the first part's index in
    `where`, for the errors)."""
    texts = []
    for j, raw in enumerate(parts, start=first):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind not in allowed:
            raise RequestError(
                f"content part type {kind!r} is not supported here; use {' or '.join(map(repr, allowed))}",
                f"{where}[{j}].type",
            )
        texts.append(convert_item(raw, ContentPart, f"{where}[{j}]").text)
    return "\n".join(texts)


def _arguments(text: str, where: str) -> dict[str, Any]:
    """A function call's arguments (JSON text) as the chat templates take them: an object."""
    try:
        arguments = json.loads(text)
    except ValueError as exc:
        raise RequestError(f"{where} is not valid JSON: {exc}", where) from None
    if not isinstance(arguments, dict):
        raise RequestError(f"{where} must be a JSON object", where)
    return arguments


def is_arguments(text: str) -> bool:
    """Whether `text` is a call's arguments as an input item takes them (a JSON object)."""
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def decode_responses_request(body: bytes) -> ResponsesRequest:
    """The request, its unknown fields refused by name."""
    try:
        return decode_request(body, ResponsesRequest)
    except RequestError as exc:
        unknown = _UNKNOWN_FIELD.search(str(exc))
        if unknown:
            name = ".".join(p for p in (unknown.group(2), unknown.group(1)) if p)
            raise RequestError(f"{name} is not a field of the Responses API", name) from None
        raise


# -- the response ---------------------------------------------------------------------------------
class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class Logprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class OutputText(msgspec.Struct, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = []
    logprobs: list[Logprob] = []


class OutputMessage(msgspec.Struct, tag_field="type", tag="message"):
    id: str
    status: str
    content: list[OutputText]
    role: str = "assistant"


class ReasoningText(msgspec.Struct, tag_field="type", tag="reasoning_text"):
    text: str


class ReasoningOutput(msgspec.Struct, tag_field="type", tag="reasoning"):
    """The model's thinking (split off by --reasoning-parser), as text; never summarized."""

    id: str
    status: str
    content: list[ReasoningText]
    summary: list[Any] = []


class FunctionCallOutput(msgspec.Struct, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    #: JSON text (what the model wrote so far, when max_output_tokens cut the call).
    arguments: str
    status: str


OutputItem = OutputMessage | ReasoningOutput | FunctionCallOutput


class InputTokensDetails(msgspec.Struct):
    #: Prompt tokens read from the prefix cache.
    cached_tokens: int = 0
    #: Prompt tokens this request computed into full blocks, which the prefix cache then keeps.
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens_details: OutputTokensDetails


class IncompleteDetails(msgspec.Struct):
    reason: str


class ResponseError(msgspec.Struct):
    code: str
    message: str


class ResponseObject(msgspec.Struct, kw_only=True):
    """The response, as `POST /v1/responses` answers it and `GET /v1/responses/{id}` returns it."""

    id: str
    model: str
    status: str
    output: list[OutputItem]
    created_at: int = msgspec.field(default_factory=lambda: int(time.time()))
    object: str = "response"
    completed_at: int | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    text: dict[str, Any] = msgspec.field(default_factory=lambda: {"format": {"type": "text"}, "verbosity": "medium"})
    tools: list[Any] = []
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    truncation: str = "disabled"
    reasoning: dict[str, Any] = msgspec.field(default_factory=lambda: {"effort": None, "summary": None})
    service_tier: str = "default"
    store: bool = True
    background: bool = False
    metadata: dict[str, str] = {}
    user: str | None = None
    usage: ResponseUsage | None = None


# -- streaming events -----------------------------------------------------------------------------
class StreamEvent(msgspec.Struct, kw_only=True, tag_field="type"):
    """One server-sent event of a streamed response; its SSE `event:` name is its `type`."""

    sequence_number: int


class ResponseCreated(StreamEvent, tag="response.created"):
    response: ResponseObject


class ResponseInProgress(StreamEvent, tag="response.in_progress"):
    response: ResponseObject


class ResponseCompleted(StreamEvent, tag="response.completed"):
    response: ResponseObject


class ResponseIncomplete(StreamEvent, tag="response.incomplete"):
    response: ResponseObject


class ResponseFailed(StreamEvent, tag="response.failed"):
    response: ResponseObject


class OutputItemAdded(StreamEvent, tag="response.output_item.added"):
    output_index: int
    item: OutputItem


class OutputItemDone(StreamEvent, tag="response.output_item.done"):
    output_index: int
    item: OutputItem


class ContentPartAdded(StreamEvent, tag="response.content_part.added"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class ContentPartDone(StreamEvent, tag="response.content_part.done"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class OutputTextDelta(StreamEvent, tag="response.output_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Logprob] = []


class OutputTextDone(StreamEvent, tag="response.output_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Logprob] = []


class ReasoningTextDelta(StreamEvent, tag="response.reasoning_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDone(StreamEvent, tag="response.reasoning_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str


class FunctionCallArgumentsDelta(StreamEvent, tag="response.function_call_arguments.delta"):
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(StreamEvent, tag="response.function_call_arguments.done"):
    item_id: str
    output_index: int
    arguments: str


def event_name(event: StreamEvent) -> str:
    """The event's `type` (its tag), which is also its SSE `event:` name."""
    return type(event).__struct_config__.tag  # type: ignore[return-value]
