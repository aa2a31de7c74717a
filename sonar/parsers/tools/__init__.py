"""Tool-call parsers: turn what a model wrote into OpenAI tool calls, whole or while streaming.

Each model family writes calls its own way; a format (`ToolCallFormat`) recognises one of them,
by name: `hermes`, `llama3_json`, `mistral`, `pythonic`, `qwen3_xml`. More register with
`register_tool_parser` (from a --tool-parser-plugin file, see `sonar.parsers.plugins`):

    from sonar.parsers.tools import ToolCallFormat, register_tool_parser

    @register_tool_parser("my_format")
    class MyFormat(ToolCallFormat):
        def scan(self, text, final): ...

`tool_call_format(name, tools)` makes one for a request; `parse_tool_calls` and `ToolCallStream`
(see `sonar.parsers.tools.base`) run it.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from sonar.parsers.plugins import ParserError
from sonar.parsers.tools.base import (
    Call,
    ParsedToolCall,
    Segment,
    Text,
    ToolCallDelta,
    ToolCallFormat,
    ToolCallsResult,
    ToolCallStream,
    ToolStreamDelta,
    parse_tool_calls,
)
from sonar.parsers.tools.hermes import HermesFormat
from sonar.parsers.tools.llama3_json import Llama3JsonFormat
from sonar.parsers.tools.mistral import MistralFormat
from sonar.parsers.tools.pythonic import PythonicFormat
from sonar.parsers.tools.qwen3_xml import Qwen3XmlFormat

TOOL_PARSERS: dict[str, type[ToolCallFormat]] = {}
#: The parsers Sonar itself implements (the rest of --tool-call-parser's documented names are not).
BUILTIN_TOOL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_xml")


def register_tool_parser(name: str) -> Callable[[type[ToolCallFormat]], type[ToolCallFormat]]:
    """A class decorator: make the format available as --tool-call-parser `name`."""

    def register(cls: type[ToolCallFormat]) -> type[ToolCallFormat]:
        if not (isinstance(cls, type) and issubclass(cls, ToolCallFormat)):
            raise ParserError(f"tool parser {name!r}: {cls!r} is not a ToolCallFormat subclass")
        TOOL_PARSERS[name] = cls
        return cls

    return register


def tool_call_format(name: str, tools: Mapping[str, Mapping[str, Any]] | None = None) -> ToolCallFormat:
    """The format registered as `name`, for a request whose tools' parameter schemas are `tools`."""
    cls = TOOL_PARSERS.get(name)
    if cls is None:
        raise ParserError(f"unknown tool-call parser {name!r} (known: {', '.join(sorted(TOOL_PARSERS))})")
    return cls(tools)


for _cls in (HermesFormat, Llama3JsonFormat, MistralFormat, PythonicFormat, Qwen3XmlFormat):
    register_tool_parser(_cls.name)(_cls)

__all__ = [
    "BUILTIN_TOOL_PARSERS",
    "TOOL_PARSERS",
    "Call",
    "ParsedToolCall",
    "Segment",
    "Text",
    "ToolCallDelta",
    "ToolCallFormat",
    "ToolCallStream",
    "ToolCallsResult",
    "ToolStreamDelta",
    "parse_tool_calls",
    "register_tool_parser",
    "tool_call_format",
]
