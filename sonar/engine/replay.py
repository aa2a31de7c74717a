"""Moving a request off a lost data-parallel replica: its replay on another one.

When a replica's worker stays down (its node is lost: `sonar.engine.client` waits
`sonar.engine.replicas.WORKER_LOST_AFTER` seconds), or the replica's engine stops, the frontend
submits each request it had there again, whole, to a replica that serves, under a new engine id.
The client already holds what the lost replica produced, so the replay's first tokens are not
sent again: `Replay` keeps what went out per completion (tokens, text length, prompt logprob
positions) and trims each replayed delta to what is new. Decoding is deterministic for greedy
and seeded sampling, so the replay repeats those tokens exactly and the stream goes on where it
stopped; a replay whose repeated tokens differ (random sampling without a seed) cannot continue
the client's text and ends the request with `EngineDeadError` (503) instead.

A pure core over `OutputDelta` values: no actors, no I/O.
"""

from __future__ import annotations

import msgspec

from sonar.errors import EngineDeadError
from sonar.protocol.engine import OutputDelta


class Replay:
    """What one completion sent to the client, and how far a replay of it has come."""

    __slots__ = ("tokens", "text_len", "prompt_sent", "_seen_tokens", "_seen_text", "_seen_prompt", "replaying")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        """The token ids the client has, in order."""
        self.text_len = 0
        self.prompt_sent = 0
        """Prompt positions whose logprobs the client has."""
        self.replaying = False
        self._seen_tokens = 0
        self._seen_text = 0
        self._seen_prompt = 0

    def restart(self) -> None:
        """The completion starts again from its prompt elsewhere."""
        self.replaying = True
        self._seen_tokens = self._seen_text = self._seen_prompt = 0

    def take(self, delta: OutputDelta) -> OutputDelta | None:
        """`delta` less what the client already has (None: nothing new in it), and remember what
        goes out. Raises `EngineDeadError` when a replay does not repeat the tokens sent."""
        if self.replaying:
            delta = self._trim(delta)
            if delta is None:
                return None
        self.tokens += delta.token_ids
        self.text_len += len(delta.text)
        self.prompt_sent += len(delta.prompt_logprobs or ())
        return delta

    def _trim(self, delta: OutputDelta) -> OutputDelta | None:
        sent = len(self.tokens)
        start = self._seen_tokens
        self._seen_tokens += len(delta.token_ids)
        repeated = delta.token_ids[: max(0, sent - start)]
        if repeated != self.tokens[start : start + len(repeated)] or (
            delta.finish_reason is not None and self._seen_tokens < sent
        ):
            raise EngineDeadError(
                "the replica serving this request was lost and its replay on another replica did not repeat the "
                "tokens already sent (sampling without a seed does not repeat); retry the request"
            )
        text_start = self._seen_text
        self._seen_text += len(delta.text)
        prompt_start = self._seen_prompt
        self._seen_prompt += len(delta.prompt_logprobs or ())
        skip = len(repeated)
        fresh_prompt = (delta.prompt_logprobs or [])[max(0, self.prompt_sent - prompt_start) :]
        if skip == len(delta.token_ids) and delta.finish_reason is None and not fresh_prompt:
            return None
        self.replaying = self._seen_tokens < sent
        return msgspec.structs.replace(
            delta,
            token_ids=delta.token_ids[skip:],
            text=delta.text[max(0, self.text_len - text_start) :],
            logprobs=None if delta.logprobs is None else delta.logprobs[skip:],
            prompt_logprobs=fresh_prompt or None if delta.prompt_logprobs is not None else None,
        )
