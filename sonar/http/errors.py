"""The one mapping from exceptions to HTTP: OpenAI's error JSON with the status each error carries.

`error_from_exception` decides the status and body; `EXCEPTION_HANDLERS` installs it as the app's
exception handler, so an endpoint raises and never catches. A stream that has sent its first
event can no longer change its status: `sonar.http.sse` sends the same body as an error event.
"""

from __future__ import annotations

import math
from contextvars import ContextVar
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from sonar.errors import (
    EngineDeadError,
    EngineSleepingError,
    InvalidRequestError,
    RequestQuarantinedError,
    SamplingFailedError,
    ServerOverloadedError,
    SonarError,
)
from sonar.http.protocol import ErrorInfo, ErrorResponse, RequestError
from sonar.http.responses import json_response
from sonar.log import get_logger

log = get_logger("sonar.http")

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    409: "ConflictError",
    408: "BadRequestError",
    413: "BadRequestError",
    429: "RateLimitError",
    431: "BadRequestError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


#: The OpenAI error codes an error body carries in place of its status: what clients key on.
OPENAI_CODES = frozenset({"context_length_exceeded", "model_not_found"})


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> ErrorResponse:
    """`code`: one of `OPENAI_CODES` in place of the status (any other is left out)."""
    info = ErrorInfo(
        message=message,
        type=ERROR_TYPES.get(status, "Error"),
        param=param,
        code=code if code in OPENAI_CODES else status,
    )
    return ErrorResponse(info)


def error_response(message: str, status: int, param: str | None = None, code: str | None = None) -> Response:
    return json_response(error_body(message, status, param, code), status)


_LOG_STACKS: ContextVar[bool] = ContextVar("sonar_log_error_stack", default=False)
"""Set for the requests of an app with --log-error-stack (`ErrorStackLogging`)."""


class ErrorStackLogging:
    """--log-error-stack: every error response of the requests passing through logs the traceback
    of the exception behind it (`request.error`), refusals (4xx) too. A flag in the request's
    context rather than an argument: the errors are mapped in the exception handler, in streams
    and in the Responses API, and each reads it where it is."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        token = _LOG_STACKS.set(True)
        try:
            await self.app(scope, receive, send)
        finally:
            _LOG_STACKS.reset(token)


def error_from_exception(exc: BaseException, request_id: str | None = None) -> tuple[int, ErrorResponse]:
    """The HTTP status and OpenAI error body for an exception raised while serving a request: the
    status the exception carries (`SonarError.status`, `RequestError.status`), the message for it."""
    answer = _expected_error(exc, request_id)
    if answer is None:  # a bug: always logged with its traceback
        log.error("request.failed", request_id=request_id, exc_info=exc)
        return 500, error_body(f"internal server error (request id {request_id}): {type(exc).__name__}", 500)
    if _LOG_STACKS.get():
        log.warning("request.error", request_id=request_id, status=answer[0], exc_info=exc)
    return answer


def _expected_error(exc: BaseException, request_id: str | None) -> tuple[int, ErrorResponse] | None:
    """The answer to an error raised by design (None: any other exception)."""
    if isinstance(exc, (RequestError, InvalidRequestError)):
        return exc.status, error_body(str(exc), exc.status, exc.param, exc.code)
    if isinstance(exc, EngineSleepingError):
        return exc.status, error_body(str(exc), exc.status)
    if isinstance(exc, EngineDeadError):
        return exc.status, error_body(f"the engine is not available: {exc}", exc.status)
    if isinstance(exc, ServerOverloadedError):
        return exc.status, error_body(f"the server is overloaded, retry after {retry_after(exc)} s: {exc}", exc.status)
    if isinstance(exc, RequestQuarantinedError):
        log.warning("request.quarantined", request_id=request_id, detail=str(exc))
        return exc.status, error_body(
            f"request {request_id} was quarantined after it crashed the model worker: {exc}", exc.status
        )
    if isinstance(exc, SamplingFailedError):
        log.warning("request.sampling_failed", request_id=request_id, detail=str(exc))
        return exc.status, error_body(f"request {request_id} failed alone: {exc}", exc.status)
    if isinstance(exc, SonarError) and exc.status < 500:  # another refusal of the request as sent
        return exc.status, error_body(str(exc), exc.status, getattr(exc, "param", None))
    if isinstance(exc, ClientDisconnect):  # gone before its body arrived: nobody reads the answer
        return 499, error_body("the client disconnected before the request body arrived", 499)
    return None


def retry_after(exc: ServerOverloadedError) -> int:
    """The `Retry-After` seconds of an overload: whole seconds, at least 1."""
    return max(1, math.ceil(exc.retry_after))


def exception_response(exc: BaseException, request_id: str | None = None) -> Response:
    status, body = error_from_exception(exc, request_id)
    response = json_response(body, status)
    if isinstance(exc, ServerOverloadedError):
        response.headers["retry-after"] = str(retry_after(exc))
    return response


def request_id_of(request: Request) -> str | None:
    """The response id an endpoint gave its request (`request.state.request_id`), if any."""
    return getattr(request.state, "request_id", None)


async def handle_exception(request: Request, exc: Exception) -> Response:
    """The app's exception handler: what an endpoint raised, as OpenAI's error JSON."""
    return exception_response(exc, request_id_of(request))


EXCEPTION_HANDLERS: dict[Any, Any] = {
    SonarError: handle_exception,
    ClientDisconnect: handle_exception,
    Exception: handle_exception,
}
"""For `Starlette(exception_handlers=...)`. What the endpoints raise by design (`SonarError`, a
client gone before its body arrived) is answered inside the routing, where the middleware (CORS,
body limits, load counters) see an ordinary response. Anything else is a bug: starlette hands the
`Exception` handler to its outermost middleware, which answers the same 500 and raises on, so the
server logs the traceback."""
