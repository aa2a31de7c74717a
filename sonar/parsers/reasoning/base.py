"""Splitting a reasoning model's thinking from its answer, whole or while streaming.

A format names the markers that open and close the thinking. The thinking is open when the
output starts with an opening marker, when the prompt already opened it (a chat template that
ends its generation prompt with `<think>`), or, for formats that always think (`thinks_first`),
from the start; a prompt that already closed it (`closed_by`) leaves the output all answer. It runs to the first closing marker; the rest is the answer (content), with its
leading whitespace dropped. Thinking never closed (cut by max_tokens) is all thinking.

As with tool calls, one `split` serves both: `split_reasoning` applies it to the whole text,
`ReasoningStream` after each delta, handing out what grew (holding back a half-written marker),
so a stream's pieces add up to the whole-text result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from sonar.parsers.markers import held_back


class ReasoningFormat:
    name: ClassVar[str] = ""
    #: Markers that open the thinking (the first is the canonical one).
    starts: ClassVar[tuple[str, ...]] = ()
    #: Markers that close it.
    ends: ClassVar[tuple[str, ...]] = ()
    #: The model thinks first whether or not it writes an opening marker.
    thinks_first: ClassVar[bool] = False

    def opened_by(self, prompt_tail: str) -> bool:
        """True when the prompt ends inside an open thinking block."""
        tail = prompt_tail.rstrip()
        return any(tail.endswith(s) for s in self.starts)

    def closed_by(self, prompt_tail: str) -> bool:
        """True when the prompt already ended the thinking (it ends, but for whitespace, with a
        closing marker, as Qwen3's template renders an empty `<think></think>` block when told
        not to think): the output is all answer."""
        tail = prompt_tail.rstrip()
        return any(tail.endswith(e) for e in self.ends)

    def split(self, text: str, final: bool, opened: bool = False) -> tuple[str, str]:
        """(thinking, answer) as far as `text` goes; with `opened` the prompt opened the thinking."""
        lead = text.lstrip()
        start = next((s for s in self.starts if lead.startswith(s)), None)
        if start is None and not final and any(s.startswith(lead) for s in self.starts):
            return "", ""  # an opening marker may be arriving
        if start is None and not (opened or self.thinks_first):
            return "", lead
        body = lead[len(start) :] if start is not None else lead
        found = [(k, e) for e in self.ends if (k := body.find(e)) >= 0]
        if found:
            k, end = min(found)
            return body[:k], body[k + len(end) :].lstrip()
        if final:
            return body, ""
        return body[: len(body) - held_back(body, self.ends)], ""


@dataclass(frozen=True)
class ReasoningResult:
    reasoning: str | None
    content: str | None


def split_reasoning(fmt: ReasoningFormat, text: str, opened: bool = False) -> ReasoningResult:
    """The thinking and the answer of a whole output (None where there is none)."""
    reasoning, content = fmt.split(text, True, opened)
    return ReasoningResult(reasoning or None, content or None)


class ReasoningStream:
    """Feed the output delta by delta; each feed returns (thinking piece, answer piece)."""

    def __init__(self, fmt: ReasoningFormat, opened: bool = False) -> None:
        self.fmt = fmt
        self.opened = opened
        self.text = ""
        self._sent = (0, 0)

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        return self._advance(False)

    def finish(self) -> tuple[str, str]:
        return self._advance(True)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning, content = self.fmt.split(self.text, final, self.opened)
        r, c = self._sent
        self._sent = (max(r, len(reasoning)), max(c, len(content)))
        return reasoning[r:], content[c:]
