"""`qwen3_xml`: Qwen3-Coder writes each call as XML-like tags, one value per parameter:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

The values are bare text, so each is converted by the type its tool's schema gives the parameter
(integer, number, boolean, object, array, null; string as written, without the newline after the
opening tag and before the closing one); without a schema a value that reads as JSON is taken as
JSON, any other as a string. The arguments grow one parameter at a time:
`{"city": "Paris"`, then `, "days": 3`, then `}` when the function closes.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from sonar.parsers.jsonscan import skip_ws
from sonar.parsers.tools.base import Call, Segment, Text, ToolCallFormat, text_until
from sonar.parsers.tools.hermes import close_tag

START, END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"


class Qwen3XmlFormat(ToolCallFormat):
    name = "qwen3_xml"

    def scan(self, text: str, final: bool) -> list[Segment]:
        segments: list[Segment] = []
        pos = 0
        while pos < len(text):
            content, k = text_until(text, pos, START, final)
            segments.append(content)
            if k == len(text):
                break
            call, end = self._function(text, skip_ws(text, k + len(START)), final)
            if call is None:
                if end is None and not final:
                    segments.append(Call(None))
                    break
                segments.append(Text(START))
                pos = k + len(START)
                continue
            if end is None:
                segments.append(call)
                break
            segments.append(call)
            pos = close_tag(text, end, END, final)
        return segments

    def _function(self, text: str, j: int, final: bool) -> tuple[Call | None, int | None]:
        """The call at `text[j]`, and the index past `</function>` (None: not yet). A None call
        with a None index: it may still become one; with an index: it is not one."""
        if not text.startswith(FUNCTION, j):
            return None, (None if FUNCTION.startswith(text[j:]) else j)
        close = text.find(">", j)
        if close < 0:
            return None, None if not final else j
        name = text[j + len(FUNCTION) : close].strip()
        if not name:
            return None, j
        schema = self.tools.get(name, {}).get("properties", {})
        pairs: list[str] = []
        i = close + 1
        while True:
            i = skip_ws(text, i)
            rest = text[i:]
            if rest.startswith(FUNCTION_END):
                return Call(name, "{" + ", ".join(pairs) + "}", True), i + len(FUNCTION_END)
            if rest.startswith(PARAMETER):
                key_end = text.find(">", i)
                value_end = text.find(PARAMETER_END, key_end) if key_end >= 0 else -1
                if value_end >= 0:
                    key = text[i + len(PARAMETER) : key_end].strip()
                    value = convert(text[key_end + 1 : value_end], schema.get(key))
                    pairs.append(f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")
                    i = value_end + len(PARAMETER_END)
                    continue
                if not final:  # the parameter is still arriving
                    return Call(name, "{" + ", ".join(pairs)), None
            elif not final and (FUNCTION_END.startswith(rest) or PARAMETER.startswith(rest)):
                return Call(name, "{" + ", ".join(pairs)), None
            # The end of the text, or something else: the call ends here, with what it has.
            return Call(name, "{" + ", ".join(pairs) + "}", True), i if rest.strip() else len(text)


def convert(raw: str, schema: Mapping[str, Any] | None) -> Any:
    """A parameter's text as the value its schema's type says."""
    value = raw.removeprefix("\n").removesuffix("\n")
    kind = (schema or {}).get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if value.strip() == "null" and kind != "string":
        return None
    try:
        if kind == "string":
            return value
        if kind == "integer":
            return int(value.strip())
        if kind == "number":
            number = float(value.strip())
            return int(number) if number.is_integer() and "." not in value and "e" not in value.lower() else number
        if kind == "boolean":
            lowered = value.strip().lower()
            if lowered in ("true", "false"):
                return lowered == "true"
            return value
        return json.loads(value)
    except ValueError:
        return value
