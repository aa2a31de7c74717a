"""The contract of a tool-call format, and the one driver that turns it into results and deltas.

A format only `scan`s: given all the text generated so far, it says which parts are content
(`Text`) and which are calls (`Call`: the name once it is whole, the arguments' JSON text so
far). With `final` False more text may come, so a format holds back what could still turn out to
be the start of a call (a half-written `<tool_call>`). Scans must grow: each scan's content and
each call's arguments extend those of the scan before, the calls keep their order and names.

`parse_tool_calls` scans the whole text once; `ToolCallStream` scans after every delta and hands
out what grew, as OpenAI's stream deltas (a call's id and name once, then its arguments in
pieces). Both normalise the same way (the content is stripped; empty content is None), so the
deltas of a stream add up to the whole-text result.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Sequence

from sonar.parsers.jsonscan import Invalid, Member, object_members
from sonar.parsers.markers import held_back

_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    """An OpenAI-style tool call id: `call_` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ALPHABET) for _ in range(24))


@dataclass(frozen=True)
class Text:
    """Content the model wrote outside any call."""

    text: str


@dataclass(frozen=True)
class Call:
    """A call as far as it is known: `name` None until it is whole; `arguments` is JSON text
    (a prefix of the final text until `complete`)."""

    name: str | None
    arguments: str = ""
    complete: bool = False


Segment = Text | Call


class ToolCallFormat:
    """One model family's way of writing tool calls. `tools` maps each tool's name to its
    parameters' JSON schema (formats that write untyped values convert them by it)."""

    name: ClassVar[str] = ""
    #: The format's markers are special tokens: the output must keep them to be parsed.
    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self, tools: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self.tools = dict(tools or {})

    def scan(self, text: str, final: bool) -> list[Segment]:
        raise NotImplementedError


@dataclass(frozen=True)
class ParsedToolCall:
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallsResult:
    """The whole-text result: the content outside the calls (None if there is none) and the calls."""

    content: str | None
    calls: list[ParsedToolCall]


@dataclass(frozen=True)
class ToolCallDelta:
    """One piece of a streamed call: the first carries `id` and `name`, later ones `arguments`."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


@dataclass(frozen=True)
class ToolStreamDelta:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


def _content(segments: Sequence[Segment]) -> str:
    text = "".join(s.text for s in segments if isinstance(s, Text)).lstrip()
    # Trailing whitespace waits: it is dropped if a call or the end follows it.
    return text.rstrip()


def _named_calls(segments: Sequence[Segment]) -> list[Call]:
    return [s for s in segments if isinstance(s, Call) and s.name is not None]


def parse_tool_calls(fmt: ToolCallFormat, text: str) -> ToolCallsResult:
    """The content and the calls in a whole generated text."""
    segments = fmt.scan(text, final=True)
    calls = [ParsedToolCall(new_call_id(), c.name or "", c.arguments) for c in _named_calls(segments)]
    return ToolCallsResult(_content(segments) or None, calls)


class ToolCallStream:
    """Feed the generated text delta by delta; each feed returns what grew (`finish` at the end)."""

    def __init__(self, fmt: ToolCallFormat) -> None:
        self.fmt = fmt
        self.text = ""
        self._content_sent = ""
        self._ids: list[str] = []
        self._args_sent: list[str] = []

    @property
    def calls_made(self) -> int:
        return len(self._ids)

    def feed(self, delta: str) -> ToolStreamDelta:
        self.text += delta
        return self._advance(final=False)

    def finish(self) -> ToolStreamDelta:
        return self._advance(final=True)

    def _advance(self, final: bool) -> ToolStreamDelta:
        segments = self.fmt.scan(self.text, final)
        # A well-behaved format only ever extends what was sent; what does not extend it (a
        # malformed call that a later scan reads otherwise) is not sent, as it cannot be taken back.
        content = _content(segments)
        piece = _extension(self._content_sent, content)
        self._content_sent += piece
        deltas: list[ToolCallDelta] = []
        for index, call in enumerate(_named_calls(segments)):
            if index == len(self._ids):
                self._ids.append(new_call_id())
                self._args_sent.append("")
                deltas.append(ToolCallDelta(index, self._ids[index], call.name))
            grown = _extension(self._args_sent[index], call.arguments)
            if grown:
                deltas.append(ToolCallDelta(index, arguments=grown))
                self._args_sent[index] += grown
        return ToolStreamDelta(piece, deltas)


def _extension(sent: str, now: str) -> str:
    return now[len(sent) :] if now.startswith(sent) else ""


# -- helpers the formats share --------------------------------------------------------------------
def text_until(text: str, pos: int, marker: str, final: bool) -> tuple[Text, int]:
    """The content from `pos` up to `marker` (or the end, less what could start the marker)."""
    k = text.find(marker, pos)
    if k >= 0:
        return Text(text[pos:k]), k
    tail = text[pos:]
    keep = len(tail) - (0 if final else held_back(tail, [marker]))
    return Text(tail[:keep]), len(text)


def json_object_call(
    text: str,
    i: int,
    final: bool,
    name_key: str = "name",
    argument_keys: Sequence[str] = ("arguments", "parameters"),
) -> tuple[Call, int | None]:
    """The call written as the JSON object at `text[i]` (`{"name": ..., "arguments": {...}}`) and
    the index past it (None: not finished). The arguments are the model's own JSON text.
    Raises Invalid when the object is not a call (another first key, a name that is no string)."""
    members, end = object_members(text, i, final)
    known = (name_key, *argument_keys)
    if members and members[0].key not in known:
        raise Invalid
    name = None
    args: Member | None = None
    for m in members:
        if m.key == name_key and m.end is not None:
            value = json.loads(text[m.start : m.end])
            if not isinstance(value, str):
                raise Invalid
            name = value
        elif m.key in argument_keys and args is None:
            args = m
    if end is not None and name is None:
        raise Invalid
    if args is None:
        arguments = "{}" if end is not None else ""
    else:
        arguments = text[args.start : len(text) if args.end is None else args.end]
    return Call(name, arguments, end is not None), end


__all__ = [
    "Call",
    "ParsedToolCall",
    "Segment",
    "Text",
    "ToolCallDelta",
    "ToolCallFormat",
    "ToolCallStream",
    "ToolCallsResult",
    "ToolStreamDelta",
    "json_object_call",
    "new_call_id",
    "parse_tool_calls",
    "text_until",
]
