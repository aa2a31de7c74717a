"""Incremental detokenization with stop strings: token ids in, text deltas out. No I/O.

One `IncrementalDetokenizer` per request (per sequence when `n > 1`). Each step the detokenizer
actor feeds it the request's new token ids and sends on the returned text delta.

Decoding keeps two offsets into the token ids, as the usual incremental approach does: text is
decoded only over a short window, `ids[prefix:]`, and compared with the decode of
`ids[prefix:read]` (tokens already turned into text), so each step costs a couple of decodes of
a few tokens, not a decode of the whole output. Decoding from a token before the new ones keeps
what the tokenizer's decoder does at the start of a string (SentencePiece's leading-space strip)
out of the delta. While the window's text ends in U+FFFD the last character is incomplete
(a multi-byte character split over byte-level or byte-fallback tokens), and the text is held
back until a later token completes it.

Stop strings are searched across token boundaries in the decoded text. Text that could still
become the start of a stop string (the longest suffix that is a prefix of one) is held back, so
a stop string never leaks out half-sent; it is cut from the output unless
`include_stop_str_in_output`. Stop token ids and EOS are the scheduler's business; the
detokenizer only leaves such a token's text out when told (`stop_token=True`).

Text is decoded with the tokenizer's Rust backend; `clean_up_tokenization_spaces` is not
applied (it rewrites text across token boundaries, so it cannot be streamed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sonar.sampling_params import SamplingParams

#: Prompt tokens decoded before the output so the first output token decodes as it would in
#: context (a SentencePiece "▁Hello" is " Hello" after a prompt, "Hello" at a string's start).
PROMPT_CONTEXT_TOKENS = 5

_REPLACEMENT = "\ufffd"


@dataclass(slots=True)
class DetokenizerUpdate:
    """What one `update` produced: new text (maybe empty) and the stop string that ended it."""

    text: str
    stop_str: str | None = None
    kept: int | None = None
    """Of the ids given, how many the output keeps: those up to the one that completed the stop
    string (None: all of them)."""

    @property
    def stopped(self) -> bool:
        return self.stop_str is not None


def backend_of(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` behind a Hugging Face fast tokenizer (or the object itself)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend
    if hasattr(tokenizer, "decode") and hasattr(tokenizer, "id_to_token"):
        return tokenizer
    raise TypeError(f"need a Hugging Face fast tokenizer or a tokenizers.Tokenizer, got {type(tokenizer)!r}")


class IncrementalDetokenizer:
    """Turns one sequence's token ids into text deltas, handling stop strings.

    `prompt_token_ids` (optional) give the first output token its context; `min_tokens` keeps
    stop strings from ending the request until more than that many tokens were generated
    (vLLM's rule: the token that completes the stop counts like a stop token).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._backend = backend_of(tokenizer)
        self._skip_special = skip_special_tokens
        self._stop = [s for s in stop if s]
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens

        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        context_text = self._decode(context)
        if context_text.endswith(_REPLACEMENT):
            context, context_text = [], ""
        self._ids: list[int] = context  # only the tokens from `prefix` on are kept
        self._prefix = 0
        self._read = len(context)
        self._prefix_text = context_text
        self._num_output_tokens = 0
        self._text = ""
        self._emitted = 0
        self._stop_str: str | None = None
        self._finished = False

    @classmethod
    def from_params(
        cls, tokenizer: Any, params: SamplingParams, prompt_token_ids: Sequence[int] = ()
    ) -> "IncrementalDetokenizer":
        return cls(
            tokenizer,
            prompt_token_ids=prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop_strings,
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )

    @property
    def output_text(self) -> str:
        """All text sent so far (after the request ended: the whole output)."""
        return self._text[: self._emitted]

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def stop_str(self) -> str | None:
        """The stop string that ended the request, if one did."""
        return self._stop_str

    @property
    def num_output_tokens(self) -> int:
        return self._num_output_tokens

    def update(
        self, new_token_ids: Sequence[int], *, final: bool = False, stop_token: bool = False
    ) -> DetokenizerUpdate:
        """Feed the sequence's new token ids; get the text that can be sent now.

        `final`: the request ends after these tokens (length, EOS, abort...), so everything
        held back for stop strings is released; an incomplete trailing character is dropped.
        `stop_token`: the last id is the EOS / stop token id that ended the request; its text
        is left out unless `include_stop_str_in_output` (implies `final`).
        Once a stop string has ended the request, further calls return empty updates. Several
        ids at once (a multi-step decode's) are fed one at a time while there are stop strings,
        so that the output ends at the one that completed a stop string (`DetokenizerUpdate.kept`).
        """
        if self._finished:
            return DetokenizerUpdate("")
        if self._stop and len(new_token_ids) > 1:
            text = ""
            for i, token in enumerate(new_token_ids):
                last = i == len(new_token_ids) - 1
                part = self.update([token], final=final and last, stop_token=stop_token and last)
                text += part.text
                if part.stopped:
                    return DetokenizerUpdate(text, part.stop_str, i + 1)
            return DetokenizerUpdate(text)
        final = final or stop_token
        self._num_output_tokens += len(new_token_ids)
        if stop_token and not self._include_stop and new_token_ids:
            new_token_ids = new_token_ids[:-1]
        if new_token_ids:
            self._ids.extend(new_token_ids)
            self._text += self._decode_window()

        stop_str = None
        if self._stop and self._num_output_tokens > self._min_tokens:
            found = self._find_stop()
            if found is not None:
                stop_str, cut = found
                self._text = self._text[:cut]
                final = True

        end = len(self._text) if final else len(self._text) - self._held_back()
        delta = self._text[self._emitted : end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        if final:
            self._finished = True
            self._stop_str = stop_str
        return DetokenizerUpdate(delta, stop_str)

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self._backend.decode(list(ids), skip_special_tokens=self._skip_special)

    def _decode_window(self) -> str:
        """The text of the tokens since `read`, once it ends in a complete character."""
        window = self._decode(self._ids[self._prefix :])
        if len(window) <= len(self._prefix_text) or window.endswith(_REPLACEMENT):
            return ""
        delta = window[len(self._prefix_text) :]
        # Keep only the window's tokens: the new prefix starts at the old read offset.
        del self._ids[: self._read]
        self._prefix, self._read = 0, len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return delta

    def _find_stop(self) -> tuple[str, int] | None:
        """The earliest stop string in text not yet sent, and where to cut the text.

        Text already sent cannot be taken back: a stop that is cut must start in unsent text;
        one kept in the output must end in it. (Unsent text is the held-back tail plus this
        step's delta, so the search is short.)
        """
        text = self._text
        best: tuple[int, str] | None = None
        for s in self._stop:
            start = max(self._emitted - len(s) + 1, 0) if self._include_stop else self._emitted
            index = text.find(s, start)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, s)
        if best is None:
            return None
        index, s = best
        return s, index + len(s) if self._include_stop else index

    def _held_back(self) -> int:
        """How many trailing characters could still grow into a stop string."""
        if not self._stop or self._include_stop:
            return 0
        text = self._text
        pending = len(text) - self._emitted
        hold = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, pending), hold, -1):
                if text.startswith(s[:k], len(text) - k):
                    hold = k
                    break
        return hold
