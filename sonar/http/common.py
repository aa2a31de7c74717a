"""What the endpoints share: the server's settings and engine, JSON/error responses, logprob shapes."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

import anyio
import msgspec
from starlette.responses import Response

from sonar.engine.protocol import PositionLogprobs
from sonar.errors import EngineDeadError, InvalidRequestError
from sonar.http.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    ErrorInfo,
    ErrorResponse,
    RequestError,
    TokenLogprob,
    TopLogprob,
)
from sonar.log import get_logger

log = get_logger("sonar.http")

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               500: "InternalServerError", 503: "ServiceUnavailableError"}


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
    #: Seconds /health waits for the scheduler to answer before it reports 503.
    health_timeout: float = 5.0
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
    log.error("request.failed", request_id=request_id, exc_info=exc)
    return 500, error_body(f"internal server error (request id {request_id}): {type(exc).__name__}", 500)


def exception_response(exc: BaseException, request_id: str | None = None) -> Response:
    status, body = error_from_exception(exc, request_id)
    return json_response(body, status)


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


# -- logprobs -------------------------------------------------------------------------------------
def completion_logprobs(positions: Sequence[PositionLogprobs | None], first_tokens: Sequence[str] = (),
                        offset: int = 0) -> CompletionLogprobs:
    """The legacy completions logprobs block. A None position (a prompt's first token, which has
    no logprob) takes its text from `first_tokens`; `offset` is where the first token's text starts."""
    out = CompletionLogprobs([], [], [], [])
    fallback = iter(first_tokens)
    for pos in positions:
        if pos is None:
            token, logprob, top = next(fallback, ""), None, None
        else:
            token, logprob = pos.token, pos.logprob
            top = {t.token: t.logprob for t in pos.top}
            top.setdefault(pos.token, pos.logprob)
        out.tokens.append(token)
        out.token_logprobs.append(logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(token)
    return out


def merge_completion_logprobs(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(a.tokens + b.tokens, a.token_logprobs + b.token_logprobs,
                              a.top_logprobs + b.top_logprobs, a.text_offset + b.text_offset)


def chat_logprobs(positions: Sequence[PositionLogprobs]) -> ChatLogprobs:
    return ChatLogprobs([
        TokenLogprob(p.token, p.logprob, list(p.token.encode()),
                     [TopLogprob(t.token, t.logprob, list(t.token.encode())) for t in p.top])
        for p in positions
    ])
