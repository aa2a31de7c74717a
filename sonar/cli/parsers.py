"""The tool-call and reasoning parser flags, checked while parsing so that a wrong name exits 2.

Plugins (--tool-parser-plugin, --reasoning-parser-plugin) are loaded here, before the names are
looked up: they are the operator's own Python files and may register the names asked for.
"""

from __future__ import annotations

from typing import Any

from sonar.cli.errors import UsageError
from sonar.cli.table import TOOL_CALL_PARSER_NAMES
from sonar.parsers import ParserError, load_plugin
from sonar.parsers.reasoning import BUILTIN_REASONING_PARSERS, REASONING_PARSERS
from sonar.parsers.tools import BUILTIN_TOOL_PARSERS, TOOL_PARSERS


def check_parser_flags(serve: dict[str, Any], reasoning_flag: str = "--reasoning-parser") -> None:
    """Load the plugins and check the parser names in `serve` (ServeConfig's fields);
    `reasoning_flag` is the option that named the reasoning parser."""
    for flag, field in (
        ("--tool-parser-plugin", "tool_parser_plugin"),
        ("--reasoning-parser-plugin", "reasoning_parser_plugin"),
    ):
        if serve.get(field):
            try:
                load_plugin(serve[field])
            except ParserError as exc:
                raise UsageError.bad(f"argument {flag}: {exc}") from None
    tool_parser = serve.get("tool_call_parser")
    if serve.get("enable_auto_tool_choice") and not tool_parser:
        raise UsageError.bad(
            "argument --enable-auto-tool-choice: needs --tool-call-parser "
            f"(Sonar implements {', '.join(BUILTIN_TOOL_PARSERS)})"
        )
    if tool_parser:
        if not serve.get("enable_auto_tool_choice"):
            raise UsageError.bad(
                "argument --tool-call-parser: takes effect only with --enable-auto-tool-choice "
                "(tool_choice 'required' and named functions need no parser)"
            )
        if tool_parser not in TOOL_PARSERS:
            implemented = f"Sonar implements {', '.join(BUILTIN_TOOL_PARSERS)}"
            if tool_parser in TOOL_CALL_PARSER_NAMES:
                raise UsageError.unsupported("--tool-call-parser", f"got {tool_parser}; {implemented}")
            raise UsageError.bad(
                f"argument --tool-call-parser: unknown parser {tool_parser!r} ({implemented}, "
                "or a name a --tool-parser-plugin registers)"
            )
    reasoning_parser = serve.get("reasoning_parser")
    if reasoning_parser and reasoning_parser not in REASONING_PARSERS:
        raise UsageError.bad(
            f"argument {reasoning_flag}: unknown parser {reasoning_parser!r} (Sonar implements "
            f"{', '.join(BUILTIN_REASONING_PARSERS)}, or a name a --reasoning-parser-plugin registers)"
        )
