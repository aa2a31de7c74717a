"""GET /openapi.json: the server's OpenAPI 3.1 description, built from the msgspec request and
response structs of `sonar/http/protocol.py`.

The structs carry their fixed ranges (`msgspec.Meta`); the limits that depend on the engine are
filled in here, so the schema states what this server accepts: `max_tokens` up to the model
length, `logprobs` up to --max-logprobs, token ids inside the vocabulary, and the request limits
(--max-prompt-chars, --max-stop-strings, --max-stop-string-chars, --max-stop-token-ids,
--max-logit-bias, --max-chat-messages, --max-completions-per-request as maxLength, maxItems and
maxProperties). A request the schema allows can still be refused (a 400) for what a schema cannot
say: a prompt longer than the model, `min_tokens` above `max_tokens`, more completions than
--max-completions-per-request (prompts x n), a rendered chat longer than --max-prompt-chars,
`top_logprobs` without `logprobs`; or for what is not about its fields: a body over
--max-request-body-bytes (413), a waiting queue that is full (429). With --api-key every route but
/health and /ping (and /metrics with --metrics-public) answers 401 without the key. Every error
is the OpenAI error object (`ErrorResponse`).

Nothing is accepted silently: the request objects forbid additional properties (an unknown field
is a 400 naming it), and a field Sonar declares but refuses (docs/openai_fields.md) is stated as
null or the values that ask for what Sonar does anyway (`store: false`), with why in its
description. `GET /v1/models/{model}` answers the model card, or a 404 with the code
`model_not_found`; a prompt longer than the model is a 400 with the code
`context_length_exceeded` (every other error's code is its status).

A pooling model's schema declares the pooling routes (`sonar/http/pooling.py`: /v1/embeddings,
/pooling, /classify, /score, /rerank and their other paths), with the tasks it serves, in place of
the generation routes; a generative model's leaves them out. (Either way the routes left out
answer 400.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response

import sonar
from sonar.engine.config import LIMITS
from sonar.http.pooling_protocol import (
    MAX_INPUTS,
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingRequest,
    PoolingResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from sonar.http.protocol import (
    MAX_N,
    MAX_TOP_LOGPROBS,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    Refusal,
    TokenizeRequest,
    TokenizeResponse,
)
from sonar.http.responses_protocol import ResponseObject, ResponsesRequest

_REF = "#/components/schemas/{name}"

#: The statuses an endpoint that takes a request body can answer with an error.
_ERRORS = {
    400: "Invalid request: malformed JSON, a wrong type, a value out of range, a prompt too long, "
    "a request limit exceeded (the message names its flag)",
    401: "Missing or wrong API key (only with --api-key)",
    404: "Unknown model name",
    413: "The body is larger than --max-request-body-bytes",
    429: "The server holds as many waiting requests as it may; retry after the Retry-After header's seconds",
    500: "Internal fault (the message carries the request id)",
    503: "The server is draining, the engine is not available, or --max-connections are open",
}


@dataclass(frozen=True)
class Limits:
    """The engine-dependent limits the schema states."""

    max_model_len: int
    max_logprobs: int
    vocab_size: int
    served_model_names: tuple[str, ...] = ()
    api_key: bool = False
    metrics_public: bool = False
    max_prompt_chars: int | None = None
    max_stop_strings: int | None = None
    max_stop_string_chars: int | None = None
    max_stop_token_ids: int | None = None
    max_logit_bias: int | None = None
    max_chat_messages: int | None = None
    max_completions_per_request: int | None = None
    max_structured_output_chars: int | None = None
    pooling_tasks: tuple[str, ...] | None = None
    """What a pooling model serves (None: a generative model, whose schema has no pooling routes)."""
    sleep_mode: bool = False
    """``--enable-sleep-mode``: /sleep, /wake_up and /is_sleeping are served."""
    profiling: bool = False
    """``--profiler-config``: /start_profile and /stop_profile are served."""
    weight_updates: bool = False
    """``--weight-transfer-config``: /update_weights is served."""

    @classmethod
    def of(cls, llm: Any, settings: Any) -> "Limits":
        """The limits of the server around `llm` (an `LLM`) with its `ServerSettings`."""
        config = llm.config
        pooling = getattr(llm.info, "pooling", None)
        return cls(
            max_model_len=llm.info.max_model_len,
            max_logprobs=config.max_logprobs,
            vocab_size=llm.info.vocab_size,
            served_model_names=tuple(settings.served_model_names),
            api_key=bool(settings.api_keys),
            metrics_public=settings.metrics_public,
            pooling_tasks=None if pooling is None else tuple(pooling.tasks),
            sleep_mode=config.enable_sleep_mode,
            profiling=config.profiler() is not None,
            weight_updates=config.weight_transfer() is not None,
            **{name: getattr(config, name) for name in LIMITS},
        )


def build_openapi(limits: Limits) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the server's API routes."""
    structs = [
        CompletionRequest,
        ChatCompletionRequest,
        TokenizeRequest,
        DetokenizeRequest,
        CompletionResponse,
        ChatCompletionResponse,
        ChatCompletionChunk,
        TokenizeResponse,
        DetokenizeResponse,
        ModelList,
        ModelCard,
        ErrorResponse,
        ResponsesRequest,
        ResponseObject,
        *(_POOLING_STRUCTS if limits.pooling_tasks is not None else ()),
    ]
    _, components = msgspec.json.schema_components(structs, ref_template=_REF)
    _apply_limits(components, limits)
    if limits.pooling_tasks is not None:
        _apply_pooling_limits(components, limits)

    def ref(name: str) -> dict[str, Any]:
        return {"$ref": _REF.format(name=name)}

    def errors(*statuses: int) -> dict[str, Any]:
        return {
            str(s): {"description": _ERRORS[s], "content": {"application/json": {"schema": ref("ErrorResponse")}}}
            for s in statuses
        }

    def post(
        summary: str,
        request: str,
        response: str,
        *,
        chunk: str | None = None,
        events: bool = False,
        generates: bool = False,
    ) -> dict[str, Any]:
        ok: dict[str, Any] = {"application/json": {"schema": ref(response)}}
        if events:  # the Responses API's named events: `event` is the type, `data` the event as JSON
            ok["text/event-stream"] = {
                "schema": {
                    "type": "object",
                    "required": ["event", "data"],
                    "description": "with stream: true, OpenAI's response events (docs/responses_api.md); no `[DONE]`",
                    "properties": {
                        "event": {"type": "string"},
                        "data": {"type": "string", "contentMediaType": "application/json"},
                    },
                }
            }
        if chunk is not None:  # "stream": true answers server-sent events; the schema is one event's
            ok["text/event-stream"] = {
                "schema": {
                    "type": "object",
                    "required": ["data"],
                    "description": f"`data` is a {chunk} as JSON, an ErrorResponse (an error after the stream "
                    "began), or `[DONE]` (the last event)",
                    "properties": {
                        "data": {
                            "anyOf": [
                                {"const": "[DONE]"},
                                {
                                    "type": "string",
                                    "contentMediaType": "application/json",
                                    "contentSchema": {"anyOf": [ref(chunk), ref("ErrorResponse")]},
                                },
                            ]
                        },
                        "event": {"type": "string"},
                        "id": {"type": "string"},
                    },
                }
            }
        op: dict[str, Any] = {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": ref(request)}}},
            "responses": {
                "200": {"description": "OK", "content": ok},
                **errors(400, *guarded, 404, 413, *((429,) if generates else ()), 500, 503),
            },
        }
        if limits.api_key:
            op["security"] = [{"bearer": []}]
        return op

    def get(
        summary: str, content: dict[str, Any] | None, *, protected: bool = True, statuses: tuple[int, ...] = (500, 503)
    ) -> dict[str, Any]:
        ok: dict[str, Any] = {"description": "OK"}
        if content is not None:
            ok["content"] = content
        op: dict[str, Any] = {"summary": summary, "responses": {"200": ok, **errors(*statuses)}}
        if protected and limits.api_key:
            op["security"] = [{"bearer": []}]
            op["responses"].update(errors(401))
        return op

    guarded = (401,) if limits.api_key else ()
    json_object = {"application/json": {"schema": {"type": "object"}}}
    paths: dict[str, Any] = {
        "/v1/completions": {
            "post": post(
                "Text completions",
                "CompletionRequest",
                "CompletionResponse",
                chunk="CompletionResponse",
                generates=True,
            )
        },
        "/v1/chat/completions": {
            "post": post(
                "Chat completions",
                "ChatCompletionRequest",
                "ChatCompletionResponse",
                chunk="ChatCompletionChunk",
                generates=True,
            )
        },
        "/v1/responses": {
            "post": post(
                "OpenAI's Responses API (with stream: true, its named server-sent events: docs/responses_api.md)",
                "ResponsesRequest",
                "ResponseObject",
                events=True,
                generates=True,
            )
        },
        "/tokenize": {"post": post("Prompt or messages to token ids", "TokenizeRequest", "TokenizeResponse")},
        "/detokenize": {"post": post("Token ids to text", "DetokenizeRequest", "DetokenizeResponse")},
        "/v1/models": {"get": get("The served model names", {"application/json": {"schema": ref("ModelList")}})},
        "/v1/models/{model}": {
            "get": {
                **get(
                    "One served model's card (404, code model_not_found, for another name)",
                    {"application/json": {"schema": ref("ModelCard")}},
                    statuses=(404, 500, 503),
                ),
                "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
            }
        },
        "/health": {
            "get": {
                "summary": "200 when the engine answers within its deadline, else 503",
                "responses": {
                    "200": {"description": "Serving"},
                    "503": {"description": "Starting, draining or given up"},
                },
            }
        },
        "/version": {"get": get("The server's version", json_object)},
        "/load": {"get": get("Requests in flight", json_object)},
        "/actors": {
            "get": get(
                "The supervision tree (transport addresses only with the key, or to a loopback "
                "client when no key is set)",
                json_object,
            )
        },
        "/metrics": {
            "get": get(
                "Prometheus metrics",
                {"text/plain": {"schema": {"type": "string"}}},
                protected=not limits.metrics_public,
            )
        },
    }
    if limits.pooling_tasks is not None:  # a pooling model generates nothing: those routes answer 400
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
            del paths[path]
        for path, summary, request, response in _POOLING_ROUTES:
            paths[path] = {"post": post(summary, request, response, generates=True)}
    paths.update(_admin_paths(limits, json_object, errors(500, 503)))
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "Sonar: OpenAI-compatible API", "version": sonar.__version__},
        "paths": paths,
        "components": {"schemas": components},
    }
    if limits.api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc


def _admin_paths(limits: Limits, json_object: dict[str, Any], failures: dict[str, Any]) -> dict[str, Any]:
    """The operator's routes the server's flags turn on (`sonar/http/admin.py`)."""

    def query(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
        return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}

    def op(summary: str, *parameters: dict[str, Any], refused: str | None = None) -> dict[str, Any]:
        responses: dict[str, Any] = {"200": {"description": "OK", "content": json_object}}
        if parameters:
            responses["400"] = {"description": "A bad or unknown query parameter"}
        if limits.api_key:
            responses["401"] = {"description": _ERRORS[401]}
        if refused is not None:
            responses["409"] = {"description": refused}
        operation: dict[str, Any] = {
            "summary": summary,
            "parameters": list(parameters),
            "responses": {**responses, **failures},
        }
        if limits.api_key:
            operation["security"] = [{"bearer": []}]
        return operation

    paths: dict[str, Any] = {}
    if limits.sleep_mode:
        paths["/sleep"] = {
            "post": op(
                "Put the engine to sleep: level 1 frees the KV cache and moves the weights to host memory, "
                "level 2 drops the weights too; generation requests get 503 until /wake_up",
                query("level", {"type": "integer", "enum": [1, 2], "default": 1}, "How deep"),
                query("timeout", {"type": "number", "default": 60}, "Seconds the running requests get to finish"),
                refused="Requests still ran at the timeout, another sleep or wake-up is under way, or the "
                "engine sleeps at another level; nothing changed",
            )
        }
        paths["/wake_up"] = {
            "post": op(
                "Wake what sleeps (by default everything)",
                query("tags", {"type": "array", "items": {"enum": ["weights", "kv_cache"]}}, "What to wake"),
            )
        }
        paths["/is_sleeping"] = {"get": op("Whether any part of the engine sleeps")}
    if limits.profiling:
        paths["/start_profile"] = {"post": op("Start torch's profiler in the workers")}
        paths["/stop_profile"] = {"post": op("Stop the profiler and write the traces; their paths")}
    if limits.weight_updates:
        update = op(
            'Write new weights into the running model, between steps: a JSON body {"path": DIR} names a '
            "safetensors checkpoint folder; an application/octet-stream body is a safetensors file of tensors "
            "(any subset, in the served dtype). The prefix cache is dropped",
            refused="Another update is under way, or the weights sleep at level 2; nothing changed",
        )
        update["responses"]["400"] = {"description": "The update does not fit the served model; nothing changed"}
        update["requestBody"] = {
            "required": True,
            "content": {
                "application/json": {
                    "schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
                },
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
            },
        }
        paths["/update_weights"] = {"post": update}
    return paths


_POOLING_STRUCTS = (
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingRequest,
    PoolingResponse,
    ClassificationRequest,
    ClassificationResponse,
    ScoreRequest,
    ScoreResponse,
    RerankRequest,
    RerankResponse,
)

#: The pooling routes a pooling model's schema declares: path, summary, request, response.
_POOLING_ROUTES = (
    ("/v1/embeddings", "Embeddings (OpenAI's)", "EmbeddingRequest", "EmbeddingResponse"),
    ("/pooling", "Any pooling task the model serves (vLLM's)", "PoolingRequest", "PoolingResponse"),
    ("/classify", "Classification (vLLM's)", "ClassificationRequest", "ClassificationResponse"),
    *(
        (path, "Scores of text pairs: a cross-encoder's, or cosine similarity", "ScoreRequest", "ScoreResponse")
        for path in ("/score", "/v1/score")
    ),
    *(
        (path, "Documents by relevance to a query (Jina's and Cohere's shape)", "RerankRequest", "RerankResponse")
        for path in ("/rerank", "/v1/rerank", "/v2/rerank")
    ),
)


def _apply_pooling_limits(components: dict[str, Any], limits: Limits) -> None:
    """The pooling requests' real shapes: inputs (text or token ids, at most `MAX_INPUTS`), the
    tasks the model serves, the refused fields."""
    last_id = limits.vocab_size - 1
    token_ids = {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": last_id},
        "minItems": 1,
    }
    text = _bounded({"type": "string", "minLength": 1}, "maxLength", limits.max_prompt_chars)
    texts = {"type": "array", "items": text, "minItems": 1, "maxItems": MAX_INPUTS}
    inputs = {
        "anyOf": [
            text,
            texts,
            token_ids,
            {"type": "array", "items": token_ids, "minItems": 1, "maxItems": MAX_INPUTS},
        ]
    }
    for request in (EmbeddingRequest, PoolingRequest, ClassificationRequest, ScoreRequest, RerankRequest):
        props = components[request.__name__]["properties"]
        if "input" in props:
            props["input"] = inputs
        for name, refusal in request.refused.items():
            props[name] = _refused(name, refusal)
        if limits.served_model_names:
            props["model"] = {
                "anyOf": [{"type": "string", "enum": list(limits.served_model_names)}, {"type": "null"}],
                "default": None,
            }
    components["PoolingRequest"]["properties"]["task"] = {
        "anyOf": [{"enum": list(limits.pooling_tasks or ())}, {"type": "null"}],
        "default": None,
    }
    score = components["ScoreRequest"]["properties"]
    for name in ("text_1", "text_2", "queries", "documents"):
        score[name] = {"anyOf": [text, texts, {"type": "null"}], "default": None}
    rerank = components["RerankRequest"]["properties"]
    rerank["query"] = text
    rerank["documents"] = {
        "type": "array",
        "items": {"anyOf": [text, {"$ref": _REF.format(name="RerankDocument")}]},
        "minItems": 1,
        "maxItems": MAX_INPUTS,
    }


def _apply_limits(components: dict[str, Any], limits: Limits) -> None:
    """Write the engine's limits (and the prompt's real shape) into the msgspec-made schemas."""
    last_id = limits.vocab_size - 1
    token_id = {"type": "integer", "minimum": 0, "maximum": last_id}
    token_ids = {"type": "array", "items": token_id, "minItems": 1, "maxItems": limits.max_model_len}
    text = _bounded({"type": "string"}, "maxLength", limits.max_prompt_chars)
    completion = components["CompletionRequest"]["properties"]
    completion["prompt"] = {
        "anyOf": [
            text,
            _bounded({"type": "array", "items": text, "minItems": 1}, "maxItems", limits.max_completions_per_request),
            token_ids,
            _bounded(
                {"type": "array", "items": token_ids, "minItems": 1}, "maxItems", limits.max_completions_per_request
            ),
        ]
    }
    chat = components["ChatCompletionRequest"]["properties"]
    chat["messages"] = _bounded(
        {"type": "array", "items": {"$ref": _REF.format(name="ChatMessage")}, "minItems": 1},
        "maxItems",
        limits.max_chat_messages,
    )
    tokenize = components["TokenizeRequest"]["properties"]
    tokenize["prompt"] = {"anyOf": [text, {"type": "null"}], "default": None}
    tokenize["messages"] = {
        "anyOf": [
            _bounded(
                {"type": "array", "items": {"$ref": _REF.format(name="ChatMessage")}},
                "maxItems",
                limits.max_chat_messages,
            ),
            {"type": "null"},
        ],
        "default": None,
    }
    for props, names in ((completion, ("max_tokens",)), (chat, ("max_tokens", "max_completion_tokens"))):
        for name in names:
            _set_max(props[name], limits.max_model_len)
    max_logprobs = limits.max_logprobs if limits.max_logprobs >= 0 else limits.vocab_size  # -1: no cap
    _set_max(completion["logprobs"], max_logprobs)
    _set_max(chat["top_logprobs"], min(MAX_TOP_LOGPROBS, max_logprobs))
    n = min(MAX_N, limits.max_completions_per_request or MAX_N)
    stop = _bounded({"type": "string"}, "maxLength", limits.max_stop_string_chars)
    for props in (completion, chat):
        _set_max(props["n"], n)
        _set_max(props["stop_token_ids"], last_id)
        props["stop"] = {
            "anyOf": [
                stop,
                _bounded({"type": "array", "items": stop}, "maxItems", limits.max_stop_strings),
                {"type": "null"},
            ],
            "default": None,
        }
        for branch in props["stop_token_ids"]["anyOf"]:
            if branch.get("type") == "array":
                _bounded(branch, "maxItems", limits.max_stop_token_ids)
        for branch in props["logit_bias"]["anyOf"]:
            if branch.get("type") == "object":
                branch["propertyNames"] = {"pattern": "^[0-9]+$"}
                _bounded(branch, "maxProperties", limits.max_logit_bias)
    components["DetokenizeRequest"]["properties"]["tokens"] = {"type": "array", "items": token_id}
    components["TextPart"] = {
        "title": "TextPart",
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}},
        "additionalProperties": False,
    }
    for request in (CompletionRequest, ChatCompletionRequest):
        props = components[request.__name__]["properties"]
        for name, refusal in request.refused.items():
            props[name] = _refused(name, refusal)
    message = components["ChatMessage"]["properties"]
    for name in ("refusal", "annotations", "audio", "function_call"):  # a response message's, sent back empty
        message[name] = {"anyOf": [{"type": "null"}, {"const": []}], "default": None}
    # Usage comes in a stream's last chunk only.
    components["StreamOptions"]["properties"]["continuous_usage_stats"] = {
        "anyOf": [{"const": False}, {"type": "null"}],
        "default": None,
    }
    if limits.served_model_names:
        for props in (
            completion,
            chat,
            components["TokenizeRequest"]["properties"],
            components["DetokenizeRequest"]["properties"],
        ):
            props["model"] = {
                "anyOf": [{"type": "string", "enum": list(limits.served_model_names)}, {"type": "null"}],
                "default": None,
            }


def _refused(name: str, refusal: Refusal) -> dict[str, Any]:
    """A refused field's schema: null, or a value that asks for what Sonar does anyway."""
    return {
        "anyOf": [{"type": "null"}, *({"const": value} for value in refusal.inert)],
        "default": None,
        "description": f"Refused: {name} is not supported: {refusal.reason}",
    }


def _bounded(schema: dict[str, Any], keyword: str, limit: int | None) -> dict[str, Any]:
    """`schema` with `keyword` (maxLength, maxItems, maxProperties) set to `limit` (None: unbounded)."""
    if limit is not None:
        schema[keyword] = limit
    return schema


def _set_max(schema: dict[str, Any], maximum: int) -> None:
    """Set `maximum` on every integer branch of `schema` (a plain, anyOf or array-of-int schema)."""
    if schema.get("type") == "integer":
        schema["maximum"] = maximum
    if schema.get("type") == "array" and isinstance(schema.get("items"), dict):
        _set_max(schema["items"], maximum)
    for branch in schema.get("anyOf", ()):
        _set_max(branch, maximum)


def openapi_endpoint(llm: Any, settings: Any) -> Callable[[Request], Any]:
    """The GET /openapi.json handler for the app around `llm` (an `LLM`) and its `ServerSettings`."""
    body: list[bytes] = []

    async def openapi(request: Request) -> Response:
        if not body:
            body.append(msgspec.json.encode(build_openapi(Limits.of(llm, settings))))
        return Response(body[0], media_type="application/json")

    return openapi
