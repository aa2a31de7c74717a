"""The OpenAI-compatible starlette app around a running `LLM`.

    app = build_app(llm, ServerSettings(served_model_names=("my-model",)))

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET|POST /ping, GET /version, POST /tokenize, POST /detokenize, GET /tokenizer_info (only with
--enable-tokenizer-info-endpoint), and the observability routes
GET /metrics (Prometheus), GET /actors (the supervision tree), GET /load (requests in flight; see
`sonar/http/metrics.py`). With API keys set, every /v1/* route needs `Authorization: Bearer <key>`
(the others stay open, as in vLLM).
"""

from __future__ import annotations

import hmac
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
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

import sonar
from sonar.engine.client import LLM
from sonar.http.chat import create_chat_completion
from sonar.http.common import ServerSettings, error_response, exception_response, json_response
from sonar.http.completions import create_completion
from sonar.http.metrics import LoadMiddleware, ServerMetrics, stats_logging
from sonar.http.openapi import openapi_endpoint
from sonar.http.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    RequestError,
    TokenizeRequest,
    TokenizeResponse,
    decode_request,
)


class ApiKeyMiddleware:
    """401 for /v1/* requests without one of `keys` as a bearer token (compared in constant time)."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...]) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and self._protected(scope):
            auth = Headers(scope=scope).get("authorization", "")
            scheme, _, token = auth.partition(" ")
            given = token.strip().encode() if scheme.lower() == "bearer" else b""
            ok = False
            for key in self.keys:  # no early exit: every key is compared
                ok |= hmac.compare_digest(given, key)
            if not ok:
                await error_response("invalid or missing API key", 401)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    @staticmethod
    def _protected(scope: Scope) -> bool:
        path, root = scope["path"], scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        return path.startswith("/v1/") or path == "/v1"


def build_app(llm: LLM, settings: ServerSettings, *, log_stats_interval: float | None = None) -> Starlette:
    """`log_stats_interval`: seconds between stats log lines while the app runs (None: none)."""
    names = settings.served_model_names
    metrics = ServerMetrics()

    def check_model(model: str | None) -> None:
        if model is not None and model not in names:
            raise RequestError(f"The model `{model}` does not exist.", "model", status=404)

    async def completions(request: Request) -> Response:
        return await create_completion(request, llm, settings, check_model)

    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(request, llm, settings, check_model)

    async def models(request: Request) -> Response:
        root = llm.config.model or llm.info.model
        return json_response(ModelList([ModelCard(id=name, root=root, max_model_len=llm.info.max_model_len)
                                        for name in names]))

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
        try:
            req = decode_request(await request.body(), TokenizeRequest)
            check_model(req.model)
            if (req.prompt is None) == (req.messages is None):
                raise RequestError("give either prompt or messages", "prompt")
            if req.messages is not None:
                messages = [m.as_template_input(i) for i, m in enumerate(req.messages)]
                ids = await llm.apply_chat_template(
                    messages, add_generation_prompt=req.add_generation_prompt,
                    continue_final_message=req.continue_final_message, chat_template=settings.chat_template)
            else:
                prompt = req.prompt
                ids = await anyio.to_thread.run_sync(
                    lambda: llm.tokenizer(prompt, add_special_tokens=req.add_special_tokens).input_ids)
            strs = llm.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
            return json_response(TokenizeResponse(len(ids), llm.info.max_model_len, list(ids), strs))
        except Exception as exc:
            return exception_response(exc)

    async def detokenize(request: Request) -> Response:
        try:
            req = decode_request(await request.body(), DetokenizeRequest)
            check_model(req.model)
            vocab = llm.info.vocab_size
            bad = [t for t in req.tokens if not 0 <= t < vocab]
            if bad:
                raise RequestError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", "tokens")
            text = await anyio.to_thread.run_sync(lambda: llm.tokenizer.decode(req.tokens))
            return json_response(DetokenizeResponse(text))
        except Exception as exc:
            return exception_response(exc)

    async def tokenizer_info(request: Request) -> Response:
        return json_response(describe_tokenizer(llm.tokenizer, settings.chat_template))

    async def prometheus(request: Request) -> Response:
        body = await metrics.render(llm, settings.health_timeout)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def actors(request: Request) -> Response:
        return Response(msgspec.json.encode(llm.tree()), media_type="application/json")

    async def load(request: Request) -> Response:
        return json_response({"server_load": metrics.server_load})

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with stats_logging(llm, metrics, log_stats_interval):
            yield

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ping", health, methods=["GET", "POST"]),
        Route("/version", version, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/metrics", prometheus, methods=["GET"]),
        Route("/actors", actors, methods=["GET"]),
        Route("/load", load, methods=["GET"]),
    ]
    if settings.enable_tokenizer_info_endpoint:
        routes.append(Route("/tokenizer_info", tokenizer_info, methods=["GET"]))
    if settings.enable_openapi:
        routes.append(Route("/openapi.json", openapi_endpoint(llm, settings), methods=["GET"]))
    middleware = [Middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                             allow_methods=list(settings.allowed_methods),
                             allow_headers=list(settings.allowed_headers),
                             allow_credentials=settings.allow_credentials)]
    if settings.api_keys:
        middleware.append(Middleware(ApiKeyMiddleware, keys=settings.api_keys))
    middleware.append(Middleware(LoadMiddleware, metrics=metrics))
    app = Starlette(routes=routes, middleware=middleware, exception_handlers={404: _not_found, 405: _not_allowed},
                    lifespan=lifespan)
    app.state.llm = llm
    app.state.settings = settings
    app.state.metrics = metrics
    return app


def describe_tokenizer(tokenizer: Any, chat_template: str | None = None) -> dict[str, Any]:
    """GET /tokenizer_info: the tokenizer's configuration (its init arguments, as in
    tokenizer_config.json, the added-tokens table left out), its class, special tokens, maximum
    length and the chat template the server uses (--chat-template, else the tokenizer's)."""
    info = {k: _plain(v) for k, v in getattr(tokenizer, "init_kwargs", {}).items()
            if k not in ("added_tokens_decoder", "vocab_file", "merges_file", "tokenizer_file", "name_or_path")}
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
