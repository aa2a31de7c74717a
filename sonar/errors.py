"""Exceptions the library raises to its callers."""


class SonarError(Exception):
    """Base of Sonar's errors."""


class InvalidRequestError(SonarError, ValueError):
    """The request cannot be served as given (bad parameter, prompt too long, unknown token)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class EngineDeadError(SonarError, RuntimeError):
    """The engine stopped (it gave up after repeated failures, or was shut down) mid-request."""


class ServerOverloadedError(SonarError, RuntimeError):
    """The engine holds as many waiting requests as it may (``--max-waiting-seqs``); try again
    after `retry_after` seconds. HTTP answers 429 with a ``Retry-After`` header."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestQuarantinedError(SonarError, RuntimeError):
    """The request was in flight each time the worker crashed, twice, and was failed on its own so
    the other requests could go on. HTTP answers 500 naming the request."""


class SamplingFailedError(SonarError, RuntimeError):
    """No token could be drawn for the request (its row of logits was all masked, or NaN from the
    model); it was failed on its own and the batch went on. HTTP answers 500 with the reason."""
