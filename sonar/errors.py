"""Exceptions the library raises to its callers, and how a refused request says why.

Every exception Sonar defines derives from `SonarError`. Each class carries the HTTP status it
answers with (`status`): `sonar.http.errors` maps an exception to OpenAI's error JSON from it, in
one place. A request the scheduler refuses comes back as a `Rejection` (its `RejectKind` is data,
not a string to match), which `Rejection.error()` turns into the one exception the caller sees.
"""

from __future__ import annotations

import enum
from typing import ClassVar

import msgspec


class SonarError(Exception):
    """Base of Sonar's errors. `status` is the HTTP status a request failing with it answers."""

    status: ClassVar[int] = 500


class InvalidRequestError(SonarError, ValueError):
    """The request cannot be served as given (bad parameter, prompt too long, unknown token)."""

    status = 400

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class EngineDeadError(SonarError, RuntimeError):
    """The engine stopped (it gave up after repeated failures, or was shut down) mid-request."""

    status = 503


class ServerOverloadedError(SonarError, RuntimeError):
    """The engine holds as many waiting requests as it may (``--max-waiting-seqs``); try again
    after `retry_after` seconds. HTTP answers 429 with a ``Retry-After`` header."""

    status = 429

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestQuarantinedError(SonarError, RuntimeError):
    """The request was in flight each time the worker crashed, twice, and was failed on its own so
    the other requests could go on. HTTP answers 500 naming the request."""


class SamplingFailedError(SonarError, RuntimeError):
    """No token could be drawn for the request (its row of logits was all masked, or NaN from the
    model); it was failed on its own and the batch went on. HTTP answers 500 with the reason."""


class EngineSleepingError(SonarError, RuntimeError):
    """The engine is asleep, or going to sleep (``--enable-sleep-mode``, `LLM.sleep`): it takes no
    request until it is woken up (`LLM.wake_up`, ``POST /wake_up``). HTTP answers 503."""

    status = 503


class NotEnabledError(SonarError, RuntimeError):
    """An operation whose feature the engine was started without (sleep mode, the profiler); the
    message names the flag that turns it on. HTTP answers 404, as for a route the server lacks."""

    status = 404


class RejectKind(enum.Enum):
    """Why the scheduler refused a request before queueing it."""

    TOO_LONG = "too_long"
    """The prompt has more tokens than ``--max-model-len``."""
    INVALID = "invalid"
    """A limit the request itself breaks (an empty prompt, a bad ``cache_salt``, ...)."""
    DUPLICATE = "duplicate"
    """A request with this id is already queued or running."""
    OVERLOADED = "overloaded"
    """The engine holds ``--max-waiting-seqs`` waiting requests already."""
    SLEEPING = "sleeping"
    """The engine is asleep or going to sleep."""


class Rejection(msgspec.Struct, frozen=True):
    """A refused request, as the scheduler answers it: the kind and the message for the client."""

    kind: RejectKind
    message: str

    def error(self, retry_after: float = 1.0) -> SonarError:
        """The exception the caller sees: overloaded is `ServerOverloadedError` (HTTP 429),
        sleeping `EngineSleepingError` (HTTP 503), every other kind `InvalidRequestError` (HTTP 400) with the kind as its `code`."""
        if self.kind is RejectKind.OVERLOADED:
            return ServerOverloadedError(self.message, retry_after=retry_after)
        if self.kind is RejectKind.SLEEPING:
            return EngineSleepingError(self.message)
        return InvalidRequestError(
            self.message, param="prompt" if self.kind is RejectKind.TOO_LONG else None, code=self.kind.value
        )


class LoRAError(SonarError, ValueError):
    """A LoRA adapter cannot be served: a bad or missing file, or what it asks for is not supported
    or exceeds the server's limits (the message says which)."""

    status = 400


class LoRANotFoundError(LoRAError):
    """No LoRA adapter of that name is loaded."""

    status = 404
