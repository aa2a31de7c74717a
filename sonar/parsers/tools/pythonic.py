"""`pythonic`: Llama 3.2 / Llama 4 (and others prompted so) write a reply of calls as a Python list:

    [get_weather(city="Paris", days=3), get_time(zone='CET')]

optionally between `<|python_start|>` and `<|python_end|>` (Llama 4). Each call is read with
`ast` and its arguments with `ast.literal_eval`: literals only, nothing is ever evaluated. Only a
reply that starts with the list holds calls; text after it is content. A call is handed out,
name and arguments (as JSON), once it is whole: until then it might still turn out not to be
a call (`[__import__('os')...]`), and a name once streamed cannot be taken back.
"""

from __future__ import annotations

import ast
import json
import re

from sonar.parsers.jsonscan import Invalid
from sonar.parsers.tools.base import Call, Segment, Text, ToolCallFormat

START, END = "<|python_start|>", "<|python_end|>"
_NAME_OPEN = re.compile(r"\s*([A-Za-z_][\w.]*)\s*\(")
_NAME_SO_FAR = re.compile(r"\s*([A-Za-z_][\w.]*\s*)?")


class PythonicFormat(ToolCallFormat):
    name = "pythonic"

    def scan(self, text: str, final: bool) -> list[Segment]:
        lead = text.lstrip()
        if not final and (START.startswith(lead) or not lead):
            return []
        i = len(text) - len(lead)
        if lead.startswith(START):
            i += len(START)
            i += len(text[i:]) - len(text[i:].lstrip())
        if i == len(text):
            return [Text(text)] if final else []
        if text[i] != "[":
            return [Text(text)]
        try:
            calls, end = _calls(text, i, final)
        except Invalid:
            return [Text(text)]
        if end is None:
            if final and not calls:  # cut short before its first call was whole
                return [Text(text)]
            return list(calls)
        rest = text[end:]
        stripped = rest.lstrip()
        if stripped.startswith(END):
            rest = stripped[len(END) :]
        elif not final and stripped and END.startswith(stripped):
            rest = ""
        return [*calls, Text(rest)]


def _calls(text: str, i: int, final: bool) -> tuple[list[Call], int | None]:
    """The calls of the list opening at `text[i]`, and the index past its `]` (None: not yet)."""
    calls: list[Call] = []
    for element, closed in _elements(text, i + 1):
        if closed:
            if not element.strip():
                if not calls:
                    raise Invalid  # `[]` is no call
                continue  # a trailing comma
            calls.append(_call(element))
            continue
        if not (_NAME_OPEN.match(element) or _NAME_SO_FAR.fullmatch(element)):
            raise Invalid
        return (calls if final else [*calls, Call(None)]), None
    return calls, _list_end(text, i)


def _call(source: str) -> Call:
    try:
        node = ast.parse(source.strip(), mode="eval").body
    except SyntaxError:
        raise Invalid from None
    if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, (ast.Name, ast.Attribute)):
        raise Invalid
    try:
        arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        encoded = json.dumps(arguments, ensure_ascii=False)
    except (ValueError, TypeError, SyntaxError, RecursionError):
        raise Invalid from None
    if len(arguments) != len(node.keywords):
        raise Invalid  # a `**kwargs` splat
    return Call(ast.unparse(node.func), encoded, True)


def _elements(text: str, i: int):
    """The top-level elements of a Python list from `text[i]` (just past its `[`): yields
    (source, True) for each complete one, then (source so far, False) if the text ends first."""
    depth, start, j, quote = 0, i, i, ""
    while j < len(text):
        c = text[j]
        if quote:
            if c == "\\":
                j += 2
                continue
            if c == quote:
                quote = ""
        elif c in "\"'":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                if c != "]":
                    raise Invalid
                yield text[start:j], True
                return
            depth -= 1
        elif c == "," and depth == 0:
            yield text[start:j], True
            start = j + 1
        j += 1
    yield text[start:], False


def _list_end(text: str, i: int) -> int:
    depth, j, quote = 0, i, ""
    while True:
        c = text[j]
        if quote:
            if c == "\\":
                j += 2
                continue
            if c == quote:
                quote = ""
        elif c in "\"'":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
