"""Engine outputs in OpenAI's shapes: logprob blocks, usage, and --stream-interval batching."""

from __future__ import annotations

from typing import Any, AsyncIterator, Sequence

from sonar.engine.llm import StreamDelta
from sonar.http.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from sonar.http.settings import ServerSettings
from sonar.protocol.engine import PositionLogprobs


def token_name(token_id: int, token: str, as_ids: bool = False) -> str:
    """How a logprob entry names its token: the text, or `token_id:<id>` (--return-tokens-as-token-ids)."""
    return f"token_id:{token_id}" if as_ids else token


def completion_logprobs(
    positions: Sequence[PositionLogprobs | None],
    first_tokens: Sequence[str] = (),
    offset: int = 0,
    as_ids: bool = False,
) -> CompletionLogprobs:
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
    return CompletionLogprobs(
        a.tokens + b.tokens,
        a.token_logprobs + b.token_logprobs,
        a.top_logprobs + b.top_logprobs,
        a.text_offset + b.text_offset,
    )


def chat_logprobs(positions: Sequence[PositionLogprobs], as_ids: bool = False) -> ChatLogprobs:
    return ChatLogprobs(
        [
            TokenLogprob(
                token_name(p.token_id, p.token, as_ids),
                p.logprob,
                list(p.token.encode()),
                [TopLogprob(token_name(t.token_id, t.token, as_ids), t.logprob, list(t.token.encode())) for t in p.top],
            )
            for p in positions
        ]
    )


# -- usage, stream batching -----------------------------------------------------------------------
def make_usage(settings: ServerSettings, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    """The usage block; `prompt_tokens_details` only with --enable-prompt-tokens-details."""
    details = PromptTokensDetails(cached_tokens) if settings.enable_prompt_tokens_details else None
    return Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens, details)


def _merge(a: StreamDelta, b: StreamDelta) -> StreamDelta:
    def cat(x: list[Any] | None, y: list[Any] | None) -> list[Any] | None:
        return x if y is None else y if x is None else x + y

    return StreamDelta(
        a.request_id,
        a.index,
        a.text + b.text,
        a.token_ids + b.token_ids,
        b.finish_reason,
        b.stop_reason,
        cat(a.logprobs, b.logprobs),
        cat(a.prompt_logprobs, b.prompt_logprobs),
        max(a.num_prompt_tokens, b.num_prompt_tokens),
        max(a.num_cached_tokens, b.num_cached_tokens),
    )


async def batched(deltas: AsyncIterator[StreamDelta], interval: int) -> AsyncIterator[StreamDelta]:
    """--stream-interval: after each choice's first delta, which goes at once (the time to the
    first token is not stretched, as in vLLM), hold its deltas until it has `interval` new tokens
    or finishes, then yield them as one delta. An interval of 1 passes the deltas through."""
    held: dict[int, StreamDelta] = {}
    started: set[int] = set()
    async for d in deltas:
        if interval <= 1:
            yield d
            continue
        if d.index not in started:
            started.add(d.index)
            yield d
            continue
        d = _merge(held.pop(d.index), d) if d.index in held else d
        if d.finish_reason is not None or len(d.token_ids) >= interval:
            yield d
        else:
            held[d.index] = d
    for d in held.values():  # only when the engine ended without a finish reason
        yield d
