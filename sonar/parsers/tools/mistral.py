"""`mistral`: Mistral models mark calls with `[TOOL_CALLS]`, in one of two ways:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

(the JSON array of the older tokenizers; the name-then-arguments form of tokenizer v11 and
later). Text before the marker is content. The markers are special tokens, so the output keeps
special tokens when this format parses it (unless the request sets `skip_special_tokens`).
"""

from __future__ import annotations

import re

from sonar.parsers.jsonscan import Incomplete, Invalid, skip_ws, value_end
from sonar.parsers.markers import held_back
from sonar.parsers.tools.base import Call, Segment, Text, ToolCallFormat, text_until
from sonar.parsers.tools.json_list import array_calls

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[A-Za-z_][\w.\-]*")


class MistralFormat(ToolCallFormat):
    name = "mistral"
    keeps_special_tokens = True

    def scan(self, text: str, final: bool) -> list[Segment]:
        segments: list[Segment] = []
        pos = 0
        while pos < len(text):
            content, k = text_until(text, pos, MARKER, final)
            segments.append(content)
            if k == len(text):
                break
            j = skip_ws(text, k + len(MARKER))
            if j == len(text):
                segments.append(Text(text[k:]) if final else Call(None))
                break
            if text[j] == "[":
                rest, pos = array_calls(text, j, final, ("arguments", "parameters"))
                if rest and isinstance(rest[0], Text):  # not calls: the marker too is content
                    rest = [Text(text[k:j]), *rest]
            else:
                rest, pos = _named(text, k, j, final)
            segments.extend(rest)
        return segments


def _named(text: str, k: int, j: int, final: bool) -> tuple[list[Segment], int]:
    """The call `name[ARGS]{...}` at `text[j]`."""
    a = text.find(ARGS, j)
    if a < 0:
        written = text[j:]
        written = written[: len(written) - held_back(written, [ARGS])].rstrip()
        if not final and (not written or _NAME.fullmatch(written)):
            return [Call(None)], len(text)
        return [Text(text[k:])], len(text)
    name = text[j:a].strip()
    if not _NAME.fullmatch(name):
        return [Text(text[k : a + len(ARGS)])], a + len(ARGS)
    start = skip_ws(text, a + len(ARGS))
    try:
        end = value_end(text, start, final)
    except Incomplete:
        return [Call(name, text[start:])], len(text)
    except Invalid:
        return [Call(name, text[start:], True)], len(text)
    return [Call(name, text[start:end], True)], end
