"""The JSON Sonar asks for when a request forces tool calls (structured outputs), read as calls.

`tool_choice: "required"` constrains the output to a JSON array of `{"name": ..., "parameters":
{...}}`; a named function constrains it to that function's arguments object. These formats read
those outputs, whole or streaming, like any model family's format. They are not --tool-call-parser
choices: the server picks them from the request.
"""

from __future__ import annotations

from sonar.parsers.jsonscan import Invalid, skip_ws
from sonar.parsers.tools.base import Call, Segment, Text, ToolCallFormat, json_object_call


class JsonListFormat(ToolCallFormat):
    """`[{"name": "f", "parameters": {...}}, ...]`, the whole output."""

    name = "json_list"

    def scan(self, text: str, final: bool) -> list[Segment]:
        i = skip_ws(text, 0)
        if i == len(text):
            return [] if not final else [Text(text)]
        if text[i] != "[":
            return [Text(text)]
        segments, end = array_calls(text, i, final, ("parameters", "arguments"))
        return segments + [Text(text[end:])] if end < len(text) else segments


def array_calls(text: str, i: int, final: bool, argument_keys: tuple[str, ...]) -> tuple[list[Segment], int]:
    """The calls of the JSON array `[{...}, {...}]` opening at `text[i]`, and where content resumes.
    What is not a call object is content, from where it begins."""
    calls: list[Segment] = []
    j = skip_ws(text, i + 1)
    while True:
        if j == len(text):
            return (calls if final else [*calls, Call(None)]), len(text)
        if text[j] == "]" and not calls:
            return [Text(text[i : j + 1])], j + 1
        try:
            call, end = json_object_call(text, j, final, argument_keys=argument_keys)
        except Invalid:
            return [*calls, Text(text[i if not calls else j :])], len(text)
        if end is None:
            if final and call.name is None:
                return [*calls, Text(text[i if not calls else j :])], len(text)
            return [*calls, call], len(text)
        calls.append(call)
        j = skip_ws(text, end)
        if j < len(text) and text[j] == ",":
            j = skip_ws(text, j + 1)
            continue
        if j < len(text) and text[j] == "]":
            return calls, j + 1
        return calls, end if j < len(text) or final else len(text)


class NamedFunctionFormat(ToolCallFormat):
    """The whole output is the arguments of the one function the request named."""

    name = "named_function"

    def __init__(self, function: str) -> None:
        super().__init__()
        self.function = function

    def scan(self, text: str, final: bool) -> list[Segment]:
        arguments = text.strip()
        if not arguments and not final:
            return [Call(self.function)]
        return [Call(self.function, arguments or "{}", final)]
