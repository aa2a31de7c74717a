"""Structured outputs after the thinking: a request's grammar waits for the end of its reasoning.

With a reasoning parser, a model thinks first (free text) and answers after an end marker
(`</think>`, or granite's "Here is my response:"); the request's grammar constrains the answer
only. `ThinkingGate` wraps the request's matcher: until the marker it accepts every token and
allows every next token (the bitmask row is all ones), and from the token after it, it is the
matcher. The marker is matched on the bytes of the tokens (the tokenizer's decoded vocabulary),
not on token ids, so it is found however the model spelled it: one special token (Qwen3's
`</think>`), several pieces, or merged with its neighbours (". Here" + " is my response:"); what
a token carries past the marker is outside the grammar (the reasoning parser drops the
whitespace that usually is). A prompt that already ended the thinking (it ends, but for
whitespace, with a marker: Qwen3's template with ``enable_thinking=false`` renders an empty
`<think>\\n\\n</think>` block) is constrained from the first token.

Like the matcher, the gate only ever sees the tokens the request keeps, so preemption,
recompute and a worker restart need no rollback. Thinking that never ends is never
constrained: such a request ends on ``max_tokens`` (finish_reason ``length``) or EOS with no
answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sonar.core.grammar import GrammarMatcher

__all__ = ["ThinkingGate"]

_WHITESPACE = b" \t\r\n"
_PROMPT_TAIL_TOKENS = 64
"""Prompt tokens looked at for an ended thinking (a marker then whitespace fits in far fewer)."""


class ThinkingGate:
    """A `GrammarMatcher` that lets the thinking through and then is `matcher`.

    ``token_bytes[t]`` is the text of token ``t`` as UTF-8 bytes (special tokens as their text);
    ``ends`` are the end-of-thinking markers."""

    __slots__ = ("matcher", "_ends", "_token_bytes", "_keep", "_tail", "thinking")

    def __init__(
        self,
        matcher: GrammarMatcher,
        ends: Sequence[str],
        token_bytes: Sequence[bytes],
        prompt_token_ids: Sequence[int] = (),
    ) -> None:
        if not ends:
            raise ValueError("a thinking gate needs at least one end marker")
        self.matcher = matcher
        self._ends = tuple(e.encode() for e in ends)
        self._token_bytes = token_bytes
        self._keep = max(len(e) for e in self._ends) - 1
        """Bytes of the output kept to find a marker that a new token completes."""
        self._tail = b""
        self.thinking = not self._ended_in(prompt_token_ids)
        """True until the end of the thinking: the grammar does not apply yet."""

    def _text(self, token_id: int) -> bytes:
        return self._token_bytes[token_id] if 0 <= token_id < len(self._token_bytes) else b""

    def _ended_in(self, prompt_token_ids: Sequence[int]) -> bool:
        tail = b""
        for token_id in reversed(prompt_token_ids[-_PROMPT_TAIL_TOKENS:]):
            tail = self._text(token_id) + tail
            stripped = tail.rstrip(_WHITESPACE)
            if len(stripped) > self._keep:
                return any(stripped.endswith(e) for e in self._ends)
        return any(tail.rstrip(_WHITESPACE).endswith(e) for e in self._ends)

    @property
    def constraint(self) -> GrammarMatcher | None:
        """The matcher that decides the next token; None while the thinking runs (any token)."""
        return None if self.thinking else self.matcher

    def accept_token(self, token_id: int) -> bool:
        if not self.thinking:
            return self.matcher.accept_token(token_id)
        seen = self._tail + self._text(token_id)
        if any(e in seen for e in self._ends):
            self.thinking = False
            self._tail = b""
        else:
            self._tail = seen[max(0, len(seen) - self._keep) :]
        return True

    def is_terminated(self) -> bool:
        return not self.thinking and self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        if self.thinking:
            bitmask[row].fill_(-1)
        else:
            self.matcher.fill_bitmask(bitmask, row)
