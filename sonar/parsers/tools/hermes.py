"""`hermes`: Qwen2.5, Qwen3 and Hermes models write each call as JSON between tags:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text before, between and after the calls is content. A tag around something that is not a call
object stays content, as written.
"""

from __future__ import annotations

from sonar.parsers.jsonscan import Invalid, skip_ws
from sonar.parsers.tools.base import Call, Segment, Text, ToolCallFormat, json_object_call, text_until

START, END = "<tool_call>", "</tool_call>"


class HermesFormat(ToolCallFormat):
    name = "hermes"

    def scan(self, text: str, final: bool) -> list[Segment]:
        segments: list[Segment] = []
        pos = 0
        while pos < len(text):
            content, k = text_until(text, pos, START, final)
            segments.append(content)
            if k == len(text):
                break
            j = skip_ws(text, k + len(START))
            if j == len(text):
                segments.append(Text(text[k:]) if final else Call(None))
                break
            if text[j] != "{":
                segments.append(Text(START))
                pos = k + len(START)
                continue
            try:
                call, end = json_object_call(text, j, final)
            except Invalid:
                segments.append(Text(START))
                pos = k + len(START)
                continue
            if end is None:
                segments.append(Text(text[k:]) if final and call.name is None else call)
                break
            segments.append(call)
            pos = close_tag(text, end, END, final)
        return segments


def close_tag(text: str, end: int, tag: str, final: bool) -> int:
    """Where content resumes after a call that ended at `end`: past its closing tag when there is
    one (or while one may still be arriving), else right after the call."""
    j = skip_ws(text, end)
    if text.startswith(tag, j):
        return j + len(tag)
    if not final and tag.startswith(text[j:]):
        return len(text)
    return end
