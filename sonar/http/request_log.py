"""Request logging (--enable-log-requests, --enable-log-outputs, --enable-log-deltas)."""

from __future__ import annotations

from typing import Any, Sequence

import msgspec

from sonar.engine.llm import StreamDelta
from sonar.http.protocol import RequestError
from sonar.http.settings import ServerSettings
from sonar.log import get_logger

log = get_logger("sonar.http")


def _clip(value: Any, limit: int | None) -> Any:
    """A prompt or output cut to `limit` characters (a string) or ids (a list of token ids)."""
    return value if limit is None else value[:limit]


def check_user(settings: ServerSettings, user: str | None) -> None:
    """A request's `user` is metadata whose one effect is the request log line: without
    --enable-log-requests nothing would record it, so it is refused rather than dropped."""
    if user is not None and not settings.enable_log_requests:
        raise RequestError(
            "user is not supported: it is only recorded in the request log, which is off "
            "(start the server with --enable-log-requests)",
            "user",
        )


def log_request(
    settings: ServerSettings,
    request_id: str,
    prompts: Sequence[Any],
    params: Any,
    user: str | None = None,
    lora: str | None = None,
) -> None:
    """With --enable-log-requests: one line with the request's id, prompt(s), sampling params,
    LoRA adapter and the client's `user` (when it sent one: the field's one effect)."""
    if settings.enable_log_requests:
        clipped = [_clip(p, settings.max_log_len) for p in prompts]
        extra = {} if user is None else {"user": user}
        if lora is not None:
            extra["lora"] = lora
        log.info(
            "request.received",
            request_id=request_id,
            prompt=clipped[0] if len(clipped) == 1 else clipped,
            params=msgspec.json.encode(params).decode(),
            **extra,
        )


def log_output(
    settings: ServerSettings,
    request_id: str,
    texts: Sequence[str],
    finish_reasons: Sequence[Any],
    completion_tokens: int,
) -> None:
    """With --enable-log-requests and --enable-log-outputs: one line with what was generated."""
    if settings.enable_log_requests and settings.enable_log_outputs:
        clipped = [_clip(t, settings.max_log_len) for t in texts]
        log.info(
            "request.output",
            request_id=request_id,
            output=clipped[0] if len(clipped) == 1 else clipped,
            finish_reason=finish_reasons[0] if len(finish_reasons) == 1 else list(finish_reasons),
            completion_tokens=completion_tokens,
        )


def log_delta(settings: ServerSettings, request_id: str, delta: StreamDelta) -> None:
    """With --enable-log-requests, --enable-log-outputs and --enable-log-deltas: one line per
    streamed piece (as it goes out, after --stream-interval batching)."""
    if settings.enable_log_requests and settings.enable_log_outputs and settings.enable_log_deltas:
        log.info(
            "request.delta",
            request_id=request_id,
            index=delta.index,
            delta=_clip(delta.text, settings.max_log_len),
            tokens=len(delta.token_ids),
            finish_reason=delta.finish_reason,
        )
