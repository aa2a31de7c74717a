"""The error hierarchy: every exception Sonar defines is a `SonarError` carrying its HTTP status,
and a refused request's kind (data, not a string) maps to exactly one exception class."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import msgspec
import pytest

import sonar
from sonar.core.request import DuplicateRequestError, PromptTooLongError, RequestRejectedError
from sonar.errors import (
    InvalidRequestError,
    Rejection,
    RejectKind,
    ServerOverloadedError,
    SonarError,
)

#: Not errors: `self.exit()` raises it to end an actor, normally or not.
CONTROL = ("sonar.actors.actor.ActorExit",)


def _sonar_exceptions() -> list[type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(sonar.__path__, "sonar."):
        module = importlib.import_module(info.name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            name = f"{obj.__module__}.{obj.__qualname__}"
            if issubclass(obj, BaseException) and obj.__module__ == info.name and name not in CONTROL:
                found[name] = obj
    return list(found.values())


def test_every_exception_sonar_defines_is_a_sonar_error() -> None:
    classes = _sonar_exceptions()
    assert len(classes) >= 20  # the walk did find them
    outside = [f"{c.__module__}.{c.__qualname__}" for c in classes if not issubclass(c, SonarError)]
    assert outside == []
    assert all(isinstance(c.status, int) for c in classes)


@pytest.mark.parametrize(
    ("error", "kind", "param"),
    [
        (PromptTooLongError("r1", 300, 256), RejectKind.TOO_LONG, "prompt"),
        (DuplicateRequestError("r1"), RejectKind.DUPLICATE, None),
        (RequestRejectedError("r1", "the prompt is empty"), RejectKind.INVALID, None),
    ],
)
def test_a_core_rejection_becomes_one_invalid_request_error(
    error: RequestRejectedError, kind: RejectKind, param: str | None
) -> None:
    rejection = error.rejection()
    assert rejection.kind is kind and "'r1'" in rejection.message
    # it crosses process boundaries as data
    rejection = msgspec.msgpack.decode(msgspec.msgpack.encode(rejection), type=Rejection)
    raised = rejection.error()
    assert type(raised) is InvalidRequestError and raised.status == 400
    assert (raised.code, raised.param, str(raised)) == (kind.value, param, str(error))


def test_an_overloaded_rejection_is_429_with_retry_after() -> None:
    raised = Rejection(RejectKind.OVERLOADED, "256 waiting (--max-waiting-seqs)").error(retry_after=2.5)
    assert type(raised) is ServerOverloadedError and raised.status == 429 and raised.retry_after == 2.5
