"""Structured outputs after the thinking: a request's grammar waits for the end of its reasoning.

With a reasoning parser, a model thinks first (free text) and answers after an end marker
(`</think>`, or granite's "Here is my response:"); the request's grammar constrains the answer
only. `ThinkingGate` wraps the request's matcher: while the model thinks it accepts every token
and allows every next token (the bitmask row is all ones), and from the token after the end
marker on it is the matcher. The end marker is matched on the bytes of the tokens (the
tokenizer's decoded vocabulary), not on token ids, so it is found however the model spelled it:
one special token (Qwen3's `</think>`), several pieces, or merged with its neighbours (". Here" +
" is my response:"); what a token carries past the marker is outside the grammar (the reasoning
parser drops the whitespace that usually is).

Where the thinking stands at the first token, as the reasoning parser reads the same text
(`sonar.parsers.reasoning`):

* the prompt ended it (it ends, but for whitespace, with an end marker: Qwen3's template with
  ``enable_thinking=false`` renders an empty `<think>\\n\\n</think>` block): constrained from
  the first token;
* the prompt opened it (it ends with a start marker, as DeepSeek-R1's template does), or the
  format always thinks first (no `starts` given): thinking;
* otherwise (Qwen3, granite: the model may or may not think) the first token decides. It may
  be one of the grammar's tokens (the model answers at once, constrained) or a token that is a
  whole start marker (``opening_ids``, e.g. Qwen3's `<think>` special token: the thinking
  starts). A start marker the tokenizer spells in several tokens cannot open the thinking there,
  so such a model answers without thinking rather than escape the grammar.

Like the matcher, the gate only ever sees the tokens the request keeps, so preemption,
recompute and a worker restart need no rollback. Thinking that never ends is never
constrained: such a request ends on ``max_tokens`` (finish_reason ``length``) or EOS with no
answer.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from sonar.core.grammar import GrammarMatcher

__all__ = ["ThinkingGate"]

_WHITESPACE = b" \t\r\n"
_PROMPT_TAIL_TOKENS = 64
"""Prompt tokens looked at for a marker at its end (a marker then whitespace fits in far fewer)."""


class ThinkingGate:
    """A `GrammarMatcher` that lets the thinking through and then is `matcher`.

    ``token_bytes[t]`` is the text of token ``t`` as UTF-8 bytes (special tokens as their text);
    ``ends`` are the end-of-thinking markers, ``starts`` the opening ones (empty: the model
    thinks first whatever it writes); ``opening_ids`` are the tokens that are a whole start
    marker and ``opening_row`` their packed bitmask row (int32, the layout of
    `sonar.core.grammar`), allowed besides the grammar's tokens at an undecided first token."""

    __slots__ = ("matcher", "_ends", "_token_bytes", "_keep", "_tail", "thinking", "undecided", "_opening")

    def __init__(
        self,
        matcher: GrammarMatcher,
        ends: Sequence[str],
        token_bytes: Sequence[bytes],
        prompt_token_ids: Sequence[int] = (),
        *,
        starts: Sequence[str] = (),
        opening_ids: Collection[int] = frozenset(),
        opening_row: Any = None,
    ) -> None:
        if not ends:
            raise ValueError("a thinking gate needs at least one end marker")
        self.matcher = matcher
        self._ends = tuple(e.encode() for e in ends)
        self._token_bytes = token_bytes
        self._keep = max(len(e) for e in self._ends) - 1
        """Bytes of the output kept to find an end marker that a new token completes."""
        self._tail = b""
        self._opening = (frozenset(opening_ids), opening_row)
        prompt_end = self._prompt_end(prompt_token_ids, tuple(s.encode() for s in starts))
        ended = any(prompt_end.endswith(e) for e in self._ends)
        opened = any(prompt_end.endswith(s.encode()) for s in starts)
        self.thinking = not ended and (opened or not starts)
        """True until the end of the thinking: the grammar does not apply yet."""
        self.undecided = not ended and not self.thinking
        """At the first token of a model that may or may not think: the grammar's tokens and the
        opening tokens are allowed, and the one sampled decides."""

    def _text(self, token_id: int) -> bytes:
        return self._token_bytes[token_id] if 0 <= token_id < len(self._token_bytes) else b""

    def _prompt_end(self, prompt_token_ids: Sequence[int], starts: tuple[bytes, ...]) -> bytes:
        """The prompt's last bytes, trailing whitespace dropped: enough to hold any marker."""
        longest = max(len(m) for m in (*self._ends, *starts))
        tail = b""
        for token_id in reversed(prompt_token_ids[-_PROMPT_TAIL_TOKENS:]):
            tail = self._text(token_id) + tail
            if len(tail.rstrip(_WHITESPACE)) >= longest:
                break
        return tail.rstrip(_WHITESPACE)

    @property
    def constraint(self) -> GrammarMatcher | None:
        """The matcher that decides the next token; None while the thinking runs (any token)."""
        return None if self.thinking else self.matcher

    @property
    def also_allowed(self) -> Any:
        """The packed row of tokens allowed besides the matcher's (the opening tokens, at an
        undecided first token), or None."""
        return self._opening[1] if self.undecided else None

    def accept_token(self, token_id: int) -> bool:
        if self.undecided:
            self.undecided = False
            if token_id in self._opening[0]:
                self.thinking = True
                return True
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
        return not self.thinking and not self.undecided and self.matcher.is_terminated()

    def valid_prefix(self, tokens: list[int]) -> int:
        """Drafts only under the grammar: none while the thinking runs or may start (the gate's
        own state does not roll back)."""
        if self.thinking or self.undecided:
            return 0
        return self.matcher.valid_prefix(tokens)

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        if self.thinking:
            bitmask[row].fill_(-1)
            return
        self.matcher.fill_bitmask(bitmask, row)
        if self.also_allowed is not None:
            bitmask[row] |= self.also_allowed
