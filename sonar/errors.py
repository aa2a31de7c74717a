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
