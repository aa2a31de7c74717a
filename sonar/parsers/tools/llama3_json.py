"""`llama3_json`: Llama 3.1 / 3.2 / 3.3 write a whole reply of calls as JSON objects, optionally
after `<|python_tag|>`, several separated by `;`:

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

Only a reply that starts that way holds calls (as in Meta's prompt format); anything else, or a
JSON object whose first key is not `name` / `parameters`, is content. Text after the calls is
content.
"""

from __future__ import annotations

from sonar.parsers.jsonscan import Invalid, skip_ws
from sonar.parsers.tools.base import Call, Segment, Text, ToolCallFormat, json_object_call

TAG = "<|python_tag|>"


class Llama3JsonFormat(ToolCallFormat):
    name = "llama3_json"

    def scan(self, text: str, final: bool) -> list[Segment]:
        i = skip_ws(text, 0)
        if not final and TAG.startswith(text[i:]):
            return []  # nothing yet, or the tag still arriving
        j = skip_ws(text, i + len(TAG)) if text.startswith(TAG, i) else i
        if j == len(text):
            return [] if not final else [Text(text)]
        if text[j] != "{":
            return [Text(text)]
        calls: list[Segment] = []
        while True:
            try:
                call, end = json_object_call(text, j, final, argument_keys=("parameters", "arguments"))
            except Invalid:
                return calls + [Text(text[j:])] if calls else [Text(text)]
            if end is None:
                if final and call.name is None:
                    return calls + [Text(text[j:])] if calls else [Text(text)]
                return [*calls, call]
            calls.append(call)
            k = skip_ws(text, end)
            if k < len(text) and text[k] == ";":
                k = skip_ws(text, k + 1)
                if k == len(text) or text[k] == "{":
                    if k == len(text):
                        return calls if final else [*calls, Call(None)]
                    j = k
                    continue
            return [*calls, Text(text[end:])]
