"""Finding JSON values in text that may still be arriving.

`value_end` says where the JSON value starting at an index ends, `Incomplete` when the text stops
before it does (more may come), `Invalid` when it cannot be JSON. `object_members` reads a JSON
object's members as far as the text goes, each with its value's span, so a caller can hand out a
member's raw text while it grows.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from sonar.errors import SonarError

WHITESPACE = " \t\r\n"
_CLOSERS = {"{": "}", "[": "]"}
# Scanning jumps from one of these to the next: a stream rescans its text after every delta.
_STRUCTURE = re.compile(r'["{}\[\]]')


class Incomplete(SonarError):
    """The text ends inside the value (internal to the parsers: a scan then waits for more)."""


class Invalid(SonarError):
    """The text at this place is not JSON (internal to the parsers: a scan then reads content)."""


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def string_end(text: str, i: int) -> int:
    """The index just past the JSON string that opens at `text[i]` (a double quote)."""
    j = i + 1
    while (k := text.find('"', j)) >= 0:
        escapes = k - 1
        while escapes > i and text[escapes] == "\\":
            escapes -= 1
        if (k - 1 - escapes) % 2 == 0:  # not escaped
            return k + 1
        j = k + 1
    raise Incomplete


def value_end(text: str, i: int, final: bool) -> int:
    """The index just past the JSON value at `text[i]`, checked with `json.loads` once complete.
    A scalar at the end of a text that is not `final` is Incomplete (`12` may become `123`)."""
    if i >= len(text):
        raise Incomplete
    c = text[i]
    if c == '"':
        end = string_end(text, i)
    elif c in _CLOSERS:
        end = _bracket_end(text, i)
    else:
        end = i
        while end < len(text) and text[end] not in ",}]" + WHITESPACE:
            end += 1
        if end == len(text) and not final:
            raise Incomplete
    try:
        json.loads(text[i:end])
    except ValueError:
        raise Invalid from None
    return end


def _bracket_end(text: str, i: int) -> int:
    expected = [_CLOSERS[text[i]]]
    j = i + 1
    while (match := _STRUCTURE.search(text, j)) is not None:
        j = match.start()
        c = text[j]
        if c == '"':
            j = string_end(text, j)
            continue
        if c in _CLOSERS:
            expected.append(_CLOSERS[c])
        elif c != expected.pop():
            raise Invalid
        elif not expected:
            return j + 1
        j += 1
    raise Incomplete


@dataclass(frozen=True)
class Member:
    """One member of a JSON object: its key and its value's span (`end` None: still arriving)."""

    key: str
    start: int
    end: int | None


def object_members(text: str, i: int, final: bool) -> tuple[list[Member], int | None]:
    """The members of the object opening at `text[i]` and the index past its `}` (None: the text
    ends first; the last member's `end` may then be None)."""
    members: list[Member] = []
    n = len(text)
    j = skip_ws(text, i + 1)
    if j < n and text[j] == "}":
        return members, j + 1
    while True:
        j = skip_ws(text, j)
        if j == n:
            return members, None
        if text[j] != '"':
            raise Invalid
        try:
            key_end = string_end(text, j)
        except Incomplete:
            return members, None
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j == n:
            return members, None
        if text[j] != ":":
            raise Invalid
        j = skip_ws(text, j + 1)
        try:
            end = value_end(text, j, final)
        except Incomplete:
            members.append(Member(key, j, None))
            return members, None
        members.append(Member(key, j, end))
        j = skip_ws(text, end)
        if j == n:
            return members, None
        if text[j] == "}":
            return members, j + 1
        if text[j] != ",":
            raise Invalid
        j += 1
