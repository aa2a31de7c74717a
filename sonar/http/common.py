"""What the endpoints share: the server's settings and engine, JSON/error responses, logprob shapes."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

import anyio
import msgspec
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from sonar.engine.client import StreamDelta
from sonar.errors import (
    EngineDeadError,
    InvalidRequestError,
    RequestQuarantinedError,
    SamplingFailedError,
    ServerOverloadedError,
)
from sonar.http.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    ErrorInfo,
    ErrorResponse,
    PromptTokensDetails,
    RequestError,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from sonar.log import get_logger
from sonar.protocol.engine import PositionLogprobs

log = get_logger("sonar.http")

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 408: "BadRequestError",
               413: "BadRequestError", 429: "RateLimitError", 431: "BadRequestError", 500: "InternalServerError",
               503: "ServiceUnavailableError"}


@dataclass(frozen=True)
class ServerSettings:
    """The frontend's share of `ServeConfig` (the app does not depend on the CLI)."""

    served_model_names: tuple[str, ...]
    api_keys: tuple[str, ...] = ()
    chat_template: str | None = None
    response_role: str = "assistant"
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    enable_force_include_usage: bool = False
    #: Add `usage.prompt_tokens_details.cached_tokens` (prompt tokens served from the prefix cache).
    enable_prompt_tokens_details: bool = False
    #: Add an `X-Request-Id` header to every response (the client's own, else a fresh one).
    enable_request_id_headers: bool = False
    #: What responses carry as `system_fingerprint` (None: null).
    system_fingerprint: str | None = None
    #: Streams send a chunk once a choice has this many new tokens (or has finished).
    stream_interval: int = 1
    #: Logprob tokens are written `token_id:<id>` instead of their text.
    return_tokens_as_token_ids: bool = False
    #: Sampling defaults for fields a request leaves out (--generation-config and its override):
    #: SamplingParams names; `max_tokens` (generation_config's max_new_tokens) also caps requests.
    default_sampling: dict[str, Any] = field(default_factory=dict)
    #: Serve GET /tokenizer_info (--enable-tokenizer-info-endpoint).
    enable_tokenizer_info_endpoint: bool = False
    #: --enable-log-requests: one `request.received` log line per request (id, prompt, sampling).
    enable_log_requests: bool = False
    #: --enable-log-outputs (with --enable-log-requests): a `request.output` line with the output.
    enable_log_outputs: bool = False
    #: --enable-log-deltas: with the two above, also a `request.delta` line per streamed piece.
    enable_log_deltas: bool = True
    #: --max-log-len: logged prompts and outputs keep this many characters (token ids: ids).
    max_log_len: int | None = None
    #: Seconds /health waits for the scheduler to answer before it reports 503.
    health_timeout: float = 5.0
    #: Serve GET /openapi.json (off with --disable-fastapi-docs).
    enable_openapi: bool = True
    #: --metrics-public: GET /metrics answers without the API key.
    metrics_public: bool = False
    #: --max-request-body-bytes: a bigger body is refused with 413 before it is read.
    max_request_body_bytes: int = 8 * 2**20
    #: --body-read-timeout: seconds from a request's headers to the end of its body (else 408).
    body_read_timeout: float = 60.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        """The name reported in responses."""
        return self.served_model_names[0]


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(16)}"


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


def error_body(message: str, status: int, param: str | None = None) -> ErrorResponse:
    return ErrorResponse(ErrorInfo(message=message, type=ERROR_TYPES.get(status, "Error"), param=param, code=status))


def error_response(message: str, status: int, param: str | None = None) -> Response:
    return json_response(error_body(message, status, param), status)


def error_from_exception(exc: BaseException, request_id: str | None = None) -> tuple[int, ErrorResponse]:
    """The HTTP status and OpenAI error body for an exception raised while serving a request."""
    if isinstance(exc, RequestError):
        return exc.status, error_body(str(exc), exc.status, exc.param)
    if isinstance(exc, InvalidRequestError):
        return 400, error_body(str(exc), 400, exc.param)
    if isinstance(exc, EngineDeadError):
        return 503, error_body(f"the engine is not available: {exc}", 503)
    if isinstance(exc, ServerOverloadedError):
        return 429, error_body(f"the server is overloaded, retry after {retry_after(exc)} s: {exc}", 429)
    if isinstance(exc, RequestQuarantinedError):
        log.warning("request.quarantined", request_id=request_id, detail=str(exc))
        return 500, error_body(f"request {request_id} was quarantined after it crashed the model worker: {exc}", 500)
    if isinstance(exc, SamplingFailedError):
        log.warning("request.sampling_failed", request_id=request_id, detail=str(exc))
        return 500, error_body(f"request {request_id} failed alone: {exc}", 500)
    if isinstance(exc, ClientDisconnect):  # gone before its body arrived: nobody reads the answer
        return 499, error_body("the client disconnected before the request body arrived", 499)
    log.error("request.failed", request_id=request_id, exc_info=exc)
    return 500, error_body(f"internal server error (request id {request_id}): {type(exc).__name__}", 500)


def retry_after(exc: ServerOverloadedError) -> int:
    """The `Retry-After` seconds of an overload: whole seconds, at least 1."""
    return max(1, math.ceil(exc.retry_after))


def exception_response(exc: BaseException, request_id: str | None = None) -> Response:
    status, body = error_from_exception(exc, request_id)
    response = json_response(body, status)
    if isinstance(exc, ServerOverloadedError):
        response.headers["retry-after"] = str(retry_after(exc))
    return response


async def gather(calls: Sequence[Callable[[], Awaitable[Any]]]) -> list[Any]:
    """Await the calls concurrently; results in order. The first failure cancels the rest and is
    raised as itself (not inside an exception group)."""
    if len(calls) == 1:
        return [await calls[0]()]
    results: list[Any] = [None] * len(calls)
    errors: list[Exception] = []

    async def one(i: int) -> None:
        try:
            results[i] = await calls[i]()
        except Exception as exc:
            errors.append(exc)
            tg.cancel_scope.cancel()

    async with anyio.create_task_group() as tg:
        for i in range(len(calls)):
            tg.start_soon(one, i)
    if errors:
        raise errors[0]
    return results


async def cancel_on_disconnect(request: Any, call: Callable[[], Awaitable[Any]],
                               request_id: str | None = None) -> tuple[bool, Any]:
    """Await `call()` unless the client disconnects first; then cancel it (leaving the engine's
    `generate` aborts the request). Returns (finished, result); `call`'s exception is raised as is.

    Needs the request body read already: `receive()` then waits for the disconnect only.
    """
    outcome: list[Any] = []

    async def run() -> None:
        try:
            outcome.append((True, await call()))
        except Exception as exc:
            outcome.append(exc)
        tg.cancel_scope.cancel()

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        log.info("request.disconnected", request_id=request_id, detail="client gone; request aborted")
        tg.cancel_scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        tg.start_soon(run)
    if not outcome:
        return False, None
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    return outcome[0]


# -- request logging (--enable-log-requests, --enable-log-outputs) ------------------------------
def _clip(value: Any, limit: int | None) -> Any:
    """A prompt or output cut to `limit` characters (a string) or ids (a list of token ids)."""
    return value if limit is None else value[:limit]


def log_request(settings: ServerSettings, request_id: str, prompts: Sequence[Any], params: Any) -> None:
    """With --enable-log-requests: one line with the request's id, prompt(s) and sampling params."""
    if settings.enable_log_requests:
        clipped = [_clip(p, settings.max_log_len) for p in prompts]
        log.info("request.received", request_id=request_id, prompt=clipped[0] if len(clipped) == 1 else clipped,
                 params=msgspec.json.encode(params).decode())


def log_output(settings: ServerSettings, request_id: str, texts: Sequence[str], finish_reasons: Sequence[Any],
               completion_tokens: int) -> None:
    """With --enable-log-requests and --enable-log-outputs: one line with what was generated."""
    if settings.enable_log_requests and settings.enable_log_outputs:
        clipped = [_clip(t, settings.max_log_len) for t in texts]
        log.info("request.output", request_id=request_id, output=clipped[0] if len(clipped) == 1 else clipped,
                 finish_reason=finish_reasons[0] if len(finish_reasons) == 1 else list(finish_reasons),
                 completion_tokens=completion_tokens)


def log_delta(settings: ServerSettings, request_id: str, delta: StreamDelta) -> None:
    """With --enable-log-requests, --enable-log-outputs and --enable-log-deltas: one line per
    streamed piece (as it goes out, after --stream-interval batching)."""
    if settings.enable_log_requests and settings.enable_log_outputs and settings.enable_log_deltas:
        log.info("request.delta", request_id=request_id, index=delta.index,
                 delta=_clip(delta.text, settings.max_log_len), tokens=len(delta.token_ids),
                 finish_reason=delta.finish_reason)


# -- logprobs -------------------------------------------------------------------------------------
def token_name(token_id: int, token: str, as_ids: bool = False) -> str:
    """How a logprob entry names its token: the text, or `token_id:<id>` (--return-tokens-as-token-ids)."""
    return f"token_id:{token_id}" if as_ids else token


def completion_logprobs(positions: Sequence[PositionLogprobs | None], first_tokens: Sequence[str] = (),
                        offset: int = 0, as_ids: bool = False) -> CompletionLogprobs:
    """The legacy completions logprobs block. A None position (a prompt's first token, which has
    no logprob) takes its text from `first_tokens`; `offset` is where the first token's text starts.
    With `as_ids` tokens are named `token_id:<id>` (offsets still count the text)."""
    out = CompletionLogprobs([], [], [], [])
    fallback = iter(first_tokens)
    for pos in positions:
        if pos is None:
            token = text = next(fallback, "")
            logprob, top = None, None
        else:
            text, token, logprob = pos.token, token_name(pos.token_id, pos.token, as_ids), pos.logprob
            top = {token_name(t.token_id, t.token, as_ids): t.logprob for t in pos.top}
            top.setdefault(token, pos.logprob)
        out.tokens.append(token)
        out.token_logprobs.append(logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def merge_completion_logprobs(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(a.tokens + b.tokens, a.token_logprobs + b.token_logprobs,
                              a.top_logprobs + b.top_logprobs, a.text_offset + b.text_offset)


def chat_logprobs(positions: Sequence[PositionLogprobs], as_ids: bool = False) -> ChatLogprobs:
    return ChatLogprobs([
        TokenLogprob(token_name(p.token_id, p.token, as_ids), p.logprob, list(p.token.encode()),
                     [TopLogprob(token_name(t.token_id, t.token, as_ids), t.logprob, list(t.token.encode()))
                      for t in p.top])
        for p in positions
    ])


# -- usage, stream batching -----------------------------------------------------------------------
def make_usage(settings: ServerSettings, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    """The usage block; `prompt_tokens_details` only with --enable-prompt-tokens-details."""
    details = PromptTokensDetails(cached_tokens) if settings.enable_prompt_tokens_details else None
    return Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens, details)


def _merge(a: StreamDelta, b: StreamDelta) -> StreamDelta:
    def cat(x: list[Any] | None, y: list[Any] | None) -> list[Any] | None:
        return x if y is None else y if x is None else x + y

    return StreamDelta(a.request_id, a.index, a.text + b.text, a.token_ids + b.token_ids, b.finish_reason,
                       b.stop_reason, cat(a.logprobs, b.logprobs), cat(a.prompt_logprobs, b.prompt_logprobs),
                       max(a.num_prompt_tokens, b.num_prompt_tokens), max(a.num_cached_tokens, b.num_cached_tokens))


async def batched(deltas: AsyncIterator[StreamDelta], interval: int) -> AsyncIterator[StreamDelta]:
    """--stream-interval: hold each choice's deltas until it has `interval` new tokens or finishes,
    then yield them as one delta. An interval of 1 passes the deltas through."""
    held: dict[int, StreamDelta] = {}
    async for d in deltas:
        if interval <= 1:
            yield d
            continue
        d = _merge(held.pop(d.index), d) if d.index in held else d
        if d.finish_reason is not None or len(d.token_ids) >= interval:
            yield d
        else:
            held[d.index] = d
    for d in held.values():  # only when the engine ended without a finish reason
        yield d


# -- the server's phases: starting, serving, draining, dead ------------------------------------------
class Drain:
    """Where the server is in its life, and the requests in flight.

    `phase` is "starting" (the engine is loading: every route answers 503), "serving",
    "draining" (SIGTERM: new requests get 503 while those in flight finish, then the rest are
    aborted with `abort_all`) or "dead" (the engine gave up: 503 with `reason`)."""

    def __init__(self) -> None:
        self.phase = "starting"
        self.reason = ""
        self.in_flight = 0

    async def wait_idle(self, poll: float = 0.05) -> None:
        while self.in_flight:
            await anyio.sleep(poll)


async def abort_all(llm: Any) -> list[str]:
    """`llm.abort_all()`, tolerating an engine that is already going away."""
    try:
        return await llm.abort_all()
    except Exception as exc:  # the engine is going away anyway
        log.warning("shutdown.abort_failed", detail=f"{type(exc).__name__}: {exc}")
        return []


UNAVAILABLE = {
    "starting": "the server is starting: the engine is not ready yet",
    "draining": "the server is shutting down and accepts no new requests",
    "dead": "the engine is not available",
}


class FrontDoor:
    """The ASGI wrapper around the app: answers 431 to a request with too many headers and 503
    unless the server is serving, counts requests in flight for `Drain`, and adds `X-Request-Id`
    headers when asked to. `app` is set once the
    engine is ready (None while starting)."""

    def __init__(self, app: Any, drain: Drain, request_id_headers: bool = False,
                 max_header_count: int | None = None) -> None:
        self.app = app
        self.drain = drain
        self.request_id_headers = request_id_headers
        self.max_header_count = max_header_count

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            if self.app is not None:
                await self.app(scope, receive, send)
            return
        if self.request_id_headers:
            send = self._with_request_id(scope, send)
        if self.max_header_count is not None and len(scope.get("headers", ())) > self.max_header_count:
            response = error_response(f"the request has more than {self.max_header_count} headers "
                                      "(--h11-max-header-count)", 431)
            response.headers["connection"] = "close"
            await response(scope, receive, send)
            return
        drain = self.drain
        if drain.phase != "serving" or self.app is None:
            message = UNAVAILABLE.get(drain.phase, UNAVAILABLE["starting"])
            if drain.reason:
                message = f"{message}: {drain.reason}"
            response = error_response(message, 503)
            response.headers["connection"] = "close"
            await response(scope, receive, send)
            return
        drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            drain.in_flight -= 1

    @staticmethod
    def _with_request_id(scope: Any, send: Any) -> Any:
        given = next((v for k, v in scope.get("headers", ()) if k.lower() == b"x-request-id"), None)
        rid = given or secrets.token_hex(16).encode()

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"x-request-id"]
                message = {**message, "headers": headers + [(b"x-request-id", rid)]}
            await send(message)

        return send_with_id
