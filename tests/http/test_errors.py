"""The one exception-to-HTTP mapping (`sonar.http.errors.error_from_exception`): overload is 429
with a Retry-After header, a quarantined request a 500 that names it, a request limit a 400
naming its parameter; never a bare 500 for what is not a fault."""

from __future__ import annotations

import json

from sonar.errors import (
    EngineDeadError,
    InvalidRequestError,
    RequestQuarantinedError,
    SamplingFailedError,
    ServerOverloadedError,
)
from sonar.http.errors import error_from_exception, exception_response
from sonar.http.protocol import RequestError
from sonar.sampling_params import SamplingParamsError


def test_overload_is_429_with_retry_after() -> None:
    exc = ServerOverloadedError("256 requests are waiting (--max-waiting-seqs)", retry_after=2.2)
    status, body = error_from_exception(exc, "cmpl-1")
    assert status == 429 and body.error.code == 429 and body.error.type == "RateLimitError"
    assert "--max-waiting-seqs" in body.error.message
    response = exception_response(exc, "cmpl-1")
    assert response.status_code == 429 and response.headers["retry-after"] == "3"
    assert json.loads(response.body)["error"]["code"] == 429
    assert exception_response(ServerOverloadedError("full", retry_after=0.1)).headers["retry-after"] == "1"


def test_quarantined_request_is_500_naming_it() -> None:
    exc = RequestQuarantinedError("it was in flight at both worker crashes")
    status, body = error_from_exception(exc, "chatcmpl-7f3a")
    assert status == 500 and "chatcmpl-7f3a" in body.error.message and "crash" in body.error.message
    assert "retry-after" not in exception_response(exc, "chatcmpl-7f3a").headers


def test_a_failed_sampling_row_is_500_with_its_reason() -> None:
    status, body = error_from_exception(SamplingFailedError("request 'x': its logits were all NaN"), "cmpl-9")
    assert status == 500 and "cmpl-9" in body.error.message and "NaN" in body.error.message


def test_limits_and_body_errors_keep_their_status() -> None:
    status, body = error_from_exception(InvalidRequestError("stop: at most 4 stop strings", param="stop"))
    assert (status, body.error.param) == (400, "stop")
    for code in (408, 413):
        status, body = error_from_exception(RequestError("body", status=code))
        assert status == code and body.error.type == "BadRequestError"


def test_every_sonar_error_answers_with_the_status_it_carries() -> None:
    status, body = error_from_exception(SamplingParamsError("top_p", "must be in (0, 1], got 2"))
    assert (status, body.error.param, body.error.type) == (400, "top_p", "BadRequestError")
    assert error_from_exception(EngineDeadError("it gave up"))[0] == EngineDeadError.status == 503
    status, body = error_from_exception(KeyError("bug"), "cmpl-3")  # a bug: 500 naming the request
    assert status == 500 and "cmpl-3" in body.error.message and "KeyError" in body.error.message
