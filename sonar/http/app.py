"""The OpenAI-compatible starlette app around a running `LLM`.

    app = build_app(llm, ServerSettings(served_model_names=("my-model",)))

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (with GET and DELETE
/v1/responses/{id} and POST /v1/responses/{id}/cancel: `sonar/http/responses_api.py`), the pooling
routes POST /v1/embeddings, /pooling, /classify, /score (/v1/score), /rerank (/v1/rerank,
/v2/rerank) (`sonar/http/pooling.py`; a 400 unless the model is a pooling model),
GET /v1/models, GET /v1/models/{id} (404 with code "model_not_found" for a name the server does
not serve; LoRA adapters are listed with their ``parent``), POST /v1/load_lora_adapter and
/v1/unload_lora_adapter (only with ``SONAR_ALLOW_RUNTIME_LORA_UPDATING=1``: loading runs the
server's file reads on a path the client names, a privilege), GET /health, GET|POST /ping, GET /version, POST /tokenize, POST /detokenize,
GET /tokenizer_info (only with --enable-tokenizer-info-endpoint), and the observability routes
GET /metrics (Prometheus), GET /actors (the supervision tree), GET /load (requests in flight; see
`sonar/http/metrics.py`; a 404 saying why with --no-enable-server-load-tracking), the operator's routes
POST /sleep, /wake_up, GET /is_sleeping, POST /start_profile, /stop_profile (`sonar/http/admin.py`),
and GET / (the web console's page, `sonar/http/console/`). With API keys set, every route but
/health, /ping and the console's static files (and /metrics with --metrics-public) needs
`Authorization: Bearer <key>`. /actors shows the actors' transport addresses (remote hosts, ipc
paths) only to a client with the key, or, when no key is set, to a loopback client; others see
`remote` in their place. Bodies are bounded in size and read time
(`BodyLimits`).
"""

from __future__ import annotations

import hmac
import re
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import anyio
import anyio.to_thread
import msgspec
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import sonar
from sonar.actors.tree import ActorInfo
from sonar.engine.llm import LLM
from sonar.http.admin import admin_routes, trusted_client
from sonar.http.chat import create_chat_completion, image_token, template_kwargs, template_source
from sonar.http.completions import create_completion
from sonar.http.console import CONSOLE_PATHS, console_routes
from sonar.http.content_format import shape_content
from sonar.http.errors import EXCEPTION_HANDLERS, ErrorStackLogging, error_response
from sonar.http.messages import MediaSource, template_messages, template_tools
from sonar.http.metrics import LoadMiddleware, ServerMetrics, stats_logging
from sonar.http.openapi import openapi_endpoint
from sonar.http.pooling import create_classification, create_embedding, create_pooling, create_rerank, create_score
from sonar.http.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    RequestError,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
    decode_request,
)
from sonar.http.response_store import ResponseStore
from sonar.http.responses import json_response
from sonar.http.responses_api import cancel_response, create_response, delete_response, get_response
from sonar.http.settings import ServerSettings
from sonar.http.tracing import RequestTracer
from sonar.log import get_logger
from sonar.lora.registry import runtime_lora_updating

#: Routes that answer without the API key: the liveness probes (and /metrics with --metrics-public).
OPEN_PATHS = frozenset({"/health", "/ping"})

log = get_logger("sonar.http")


class ApiKeyMiddleware:
    """401 for requests without one of `keys` as a bearer token (compared in constant time), on
    every route but `open_paths`. A request that shows a key is marked (`scope["state"]`), so
    /actors may show it the transport addresses. CORS preflights (OPTIONS) pass: they carry no
    credentials and answer no data."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...], open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS":
            auth = Headers(scope=scope).get("authorization", "")
            scheme, _, token = auth.partition(" ")
            given = token.strip().encode() if scheme.lower() == "bearer" else b""
            ok = False
            for key in self.keys:  # no early exit: every key is compared
                ok |= hmac.compare_digest(given, key)
            if not ok and _route(scope) not in self.open_paths:
                await error_response("invalid or missing API key", 401)(scope, receive, send)
                return
            if ok:
                scope.setdefault("state", {})["authenticated"] = True
        await self.app(scope, receive, send)


def _route(scope: Scope) -> str:
    """The request's path without the --root-path prefix."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    return path


class BodyLimits:
    """Request bodies bounded in size and in read time.

    A body over `max_bytes` is refused with 413 before it is read: at once when Content-Length
    says so, else as soon as the bytes streamed in pass the limit (the reader gets a 413
    `RequestError`). A body that is not complete `timeout` seconds after the request's headers
    gets 408 (a slow client holds no request for longer). A response to a request whose body was
    not read to its end closes the connection, so what is left of the body is never read.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            response = error_response(self._too_large(f"its Content-Length is {int(length)}"), 413)
            response.headers["connection"] = "close"
            await response(scope, receive, send)
            return
        pending = (length.isdigit() and int(length) > 0) or "transfer-encoding" in headers
        deadline = anyio.current_time() + self.timeout
        read = 0

        async def limited_receive() -> Message:
            nonlocal pending, read
            if not pending:  # the body is in (or there is none): only the disconnect is left to wait for
                return await receive()
            with anyio.move_on_after(deadline - anyio.current_time()):
                message = await receive()
                if message["type"] == "http.request":
                    read += len(message.get("body", b""))
                    if read > self.max_bytes:
                        raise RequestError(self._too_large(f"{read} bytes arrived"), status=413)
                    pending = bool(message.get("more_body", False))
                return message
            raise RequestError(
                f"the request body did not arrive within {self.timeout:g} s (--body-read-timeout)", status=408
            )

        async def closing_send(message: Message) -> None:
            if message["type"] == "http.response.start" and pending:
                message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, limited_receive, closing_send)

    def _too_large(self, detail: str) -> str:
        return f"the request body is larger than {self.max_bytes} bytes (--max-request-body-bytes): {detail}"


#: Transport addresses in actor placements and exit reasons: tcp://host:port, ipc://path, ...
_ADDRESS = re.compile(r"\b(?:tcp|ipc|inproc|udp|epgm|pgm)://[^\s'\"),;]+")


def hide_addresses(node: ActorInfo) -> ActorInfo:
    """The tree with every transport address replaced: a remote placement reads `remote`, an
    address inside an exit reason `<address>`. Names, pids, states and counts stay."""
    placement = node.placement if node.placement in ("inprocess", "process") else "remote"
    last_exit = None if node.last_exit is None else _ADDRESS.sub("<address>", node.last_exit)
    return msgspec.structs.replace(
        node, placement=placement, last_exit=last_exit, children=[hide_addresses(c) for c in node.children]
    )


def build_app(llm: LLM, settings: ServerSettings, *, log_stats_interval: float | None = None) -> Starlette:
    """`log_stats_interval`: seconds between stats log lines while the app runs (None: none)."""
    names = settings.served_model_names
    metrics = ServerMetrics()
    tracer = RequestTracer(settings.otlp_traces_endpoint) if settings.otlp_traces_endpoint else None

    def check_model(model: str | None) -> str | None:
        """The LoRA adapter `model` names (None: the base model); 404 for a name not served."""
        if model is None or model in names:
            return None
        if llm.has_model(model):
            return model
        raise RequestError(f"The model `{model}` does not exist.", "model", status=404)

    async def completions(request: Request) -> Response:
        return await create_completion(request, llm, settings, check_model)

    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(request, llm, settings, check_model)

    store = ResponseStore(settings.max_stored_responses, settings.max_stored_response_bytes)

    async def responses(request: Request) -> Response:
        return await create_response(request, llm, settings, store, check_model)

    async def embeddings(request: Request) -> Response:
        return await create_embedding(request, llm, settings, check_model)

    async def pooling(request: Request) -> Response:
        return await create_pooling(request, llm, settings, check_model)

    async def classify(request: Request) -> Response:
        return await create_classification(request, llm, settings, check_model)

    async def score(request: Request) -> Response:
        return await create_score(request, llm, settings, check_model)

    async def rerank(request: Request) -> Response:
        return await create_rerank(request, llm, settings, check_model)

    async def stored_response(request: Request) -> Response:
        if request.method == "DELETE":
            return await delete_response(request, store)
        return await get_response(request, store)

    async def cancel(request: Request) -> Response:
        return await cancel_response(request, store)

    def card(name: str) -> ModelCard:
        return ModelCard(id=name, root=llm.config.model or llm.info.model, max_model_len=llm.info.max_model_len)

    def adapter_cards() -> list[ModelCard]:
        return [
            ModelCard(id=a.request.name, root=a.request.path, max_model_len=llm.info.max_model_len, parent=a.parent)
            for a in llm.loras()
        ]

    async def models(request: Request) -> Response:
        return json_response(ModelList([card(name) for name in names] + adapter_cards()))

    async def model(request: Request) -> Response:
        name = request.path_params["model"]
        if name in names:
            return json_response(card(name))
        found = next((c for c in adapter_cards() if c.id == name), None)
        if found is None:
            raise RequestError(f"The model `{name}` does not exist.", "model", status=404, code="model_not_found")
        return json_response(found)

    async def load_lora_adapter(request: Request) -> Response:
        req = decode_request(await request.body(), LoadLoRAAdapterRequest)
        if req.lora_name in names:
            raise RequestError(f"`{req.lora_name}` is the base model's name; give the adapter another", "lora_name")
        if req.load_inplace and llm.has_model(req.lora_name):
            await llm.load_lora(req.lora_name, req.lora_path, replace=True)
        else:
            await llm.load_lora(req.lora_name, req.lora_path)
        log.info("lora.loaded", name=req.lora_name, path=req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    async def unload_lora_adapter(request: Request) -> Response:
        req = decode_request(await request.body(), UnloadLoRAAdapterRequest)
        if req.lora_int_id is not None:
            raise RequestError("lora_int_id is not supported: name the adapter by lora_name", "lora_int_id")
        if not llm.has_model(req.lora_name):
            raise RequestError(
                f"The LoRA adapter `{req.lora_name}` is not loaded.", "lora_name", status=404, code="model_not_found"
            )
        llm.unload_lora(req.lora_name)
        log.info("lora.unloaded", name=req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    async def health(request: Request) -> Response:
        """200 when the scheduler and the worker answer within the deadline (the engine is serving), else 503."""
        try:
            await llm.ping(settings.health_timeout)
        except Exception:
            return Response(status_code=503)
        return Response(status_code=200)

    async def version(request: Request) -> Response:
        return json_response({"version": sonar.__version__})

    async def tokenize(request: Request) -> Response:
        req = decode_request(await request.body(), TokenizeRequest)
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise RequestError("give either prompt or messages", "prompt")
        for name in ("tools", "chat_template_kwargs"):
            if req.messages is None and getattr(req, name) is not None:
                raise RequestError(f"{name} only applies to messages", name)
        if req.messages is not None:
            urls: list[tuple[MediaSource, str]] = []  # images count by their placeholder rows; none is loaded
            source = template_source(llm, settings)
            messages = template_messages(req.messages, source, image_token(llm), urls)
            ids = await llm.apply_chat_template(
                shape_content(messages, req.messages, settings.chat_template_content_format, source),
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                chat_template=settings.chat_template,
                tools=template_tools(req.tools),
                chat_template_kwargs=template_kwargs(settings, req.chat_template_kwargs),
            )
            if urls and llm.info.vision is not None:
                vision = llm.info.vision
                ids = [t for i in ids for t in ([i] * vision.tokens_per_image if i == vision.image_token_id else [i])]
        else:
            ids = await llm.tokenize(req.prompt, add_special_tokens=req.add_special_tokens)
        strs = llm.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return json_response(TokenizeResponse(len(ids), llm.info.max_model_len, list(ids), strs))

    async def detokenize(request: Request) -> Response:
        req = decode_request(await request.body(), DetokenizeRequest)
        check_model(req.model)
        return json_response(DetokenizeResponse(await llm.detokenize(req.tokens)))

    async def tokenizer_info(request: Request) -> Response:
        return json_response(describe_tokenizer(llm.tokenizer, settings.chat_template))

    async def prometheus(request: Request) -> Response:
        body = await metrics.render(llm, settings.health_timeout)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def actors(request: Request) -> Response:
        tree = llm.tree()
        if not trusted_client(request.scope, settings.api_keys):
            tree = hide_addresses(tree)
        return Response(msgspec.json.encode(tree), media_type="application/json")

    async def load(request: Request) -> Response:
        if not settings.enable_server_load_tracking:
            raise RequestError("server load tracking is off (--no-enable-server-load-tracking)", status=404)
        return json_response({"server_load": metrics.server_load})

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            async with stats_logging(llm, metrics, log_stats_interval):
                yield
        finally:
            if tracer is not None:  # the spans still queued go out (bounded by the export timeout)
                await anyio.to_thread.run_sync(tracer.shutdown)

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/responses/{response_id}", stored_response, methods=["GET", "DELETE"]),
        Route("/v1/responses/{response_id}/cancel", cancel, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/pooling", pooling, methods=["POST"]),
        Route("/classify", classify, methods=["POST"]),
        *(Route(path, score, methods=["POST"]) for path in ("/score", "/v1/score")),
        *(Route(path, rerank, methods=["POST"]) for path in ("/rerank", "/v1/rerank", "/v2/rerank")),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ping", health, methods=["GET", "POST"]),
        Route("/version", version, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/metrics", prometheus, methods=["GET"]),
        Route("/actors", actors, methods=["GET"]),
        Route("/load", load, methods=["GET"]),
        *admin_routes(llm, settings.api_keys),
        *(
            [
                Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
                Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
            ]
            if runtime_lora_updating()
            else []
        ),
        *console_routes(),
    ]
    if settings.enable_tokenizer_info_endpoint:
        routes.append(Route("/tokenizer_info", tokenizer_info, methods=["GET"]))
    if settings.enable_openapi:
        routes.append(Route("/openapi.json", openapi_endpoint(llm, settings), methods=["GET"]))
    middleware = [
        *settings.middleware,
        Middleware(
            CORSMiddleware,
            allow_origins=list(settings.allowed_origins),
            allow_methods=list(settings.allowed_methods),
            allow_headers=list(settings.allowed_headers),
            allow_credentials=settings.allow_credentials,
        ),
    ]
    middleware.append(
        Middleware(BodyLimits, max_bytes=settings.max_request_body_bytes, timeout=settings.body_read_timeout)
    )
    if settings.api_keys:
        open_paths = OPEN_PATHS | CONSOLE_PATHS | ({"/metrics"} if settings.metrics_public else set())
        middleware.append(Middleware(ApiKeyMiddleware, keys=settings.api_keys, open_paths=open_paths))
    if settings.enable_server_load_tracking:
        middleware.append(Middleware(LoadMiddleware, metrics=metrics))
    if settings.log_error_stack:
        middleware.append(Middleware(ErrorStackLogging))
    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={**EXCEPTION_HANDLERS, 404: _not_found, 405: _not_allowed},
        lifespan=lifespan,
    )
    app.state.llm = llm
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.tracer = tracer
    return app


def describe_tokenizer(tokenizer: Any, chat_template: str | None = None) -> dict[str, Any]:
    """GET /tokenizer_info: the tokenizer's configuration (its init arguments, as in
    tokenizer_config.json, the added-tokens table left out), its class, special tokens, maximum
    length and the chat template the server uses (--chat-template, else the tokenizer's)."""
    info = {
        k: _plain(v)
        for k, v in getattr(tokenizer, "init_kwargs", {}).items()
        if k not in ("added_tokens_decoder", "vocab_file", "merges_file", "tokenizer_file", "name_or_path")
    }
    info["tokenizer_class"] = type(tokenizer).__name__
    info["model_max_length"] = _plain(getattr(tokenizer, "model_max_length", None))
    info["chat_template"] = chat_template or getattr(tokenizer, "chat_template", None)
    info.update({name: _plain(value) for name, value in getattr(tokenizer, "special_tokens_map", {}).items()})
    return info


def _plain(value: Any) -> Any:
    """A JSON-safe copy: AddedToken and other objects become their text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


async def _not_found(request: Request, exc: Any) -> Response:
    return error_response(f"no route {request.url.path}", 404)


async def _not_allowed(request: Request, exc: Any) -> Response:
    return error_response(f"method {request.method} is not allowed on {request.url.path}", 405)
