"""--tool-parser-plugin / --reasoning-parser-plugin files: they register parsers by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from sonar.parsers import ParserError, load_plugin
from sonar.parsers.reasoning import reasoning_format, split_reasoning
from sonar.parsers.tools import parse_tool_calls, tool_call_format

PLUGIN = '''
import json
import re

from sonar.parsers.reasoning import ReasoningFormat, register_reasoning_parser
from sonar.parsers.tools import Call, Text, ToolCallFormat, register_tool_parser


@register_tool_parser("bang")
class BangFormat(ToolCallFormat):
    """Calls written `!name {json}` on their own line."""

    def scan(self, text, final):
        segments, pos = [], 0
        for m in re.finditer(r"^!(\\w+) (\\{.*\\})$", text, re.M):
            segments += [Text(text[pos : m.start()]), Call(m.group(1), m.group(2), True)]
            pos = m.end()
        return segments + [Text(text[pos:])] if final else segments


@register_reasoning_parser("brackets")
class Brackets(ReasoningFormat):
    starts = ("[[",)
    ends = ("]]",)
'''


def test_a_plugin_registers_parsers(tmp_path: Path) -> None:
    path = tmp_path / "my_parsers.py"
    path.write_text(PLUGIN)
    load_plugin(str(path))
    load_plugin(str(path))  # once per path
    result = parse_tool_calls(tool_call_format("bang"), 'ok\n!lookup {"q": "x"}\n')
    assert result.content == "ok" and [(c.name, c.arguments) for c in result.calls] == [("lookup", '{"q": "x"}')]
    assert split_reasoning(reasoning_format("brackets"), "[[hmm]] yes").reasoning == "hmm"


def test_missing_or_broken_plugins_and_unknown_names(tmp_path: Path) -> None:
    with pytest.raises(ParserError, match="no such file"):
        load_plugin(str(tmp_path / "absent.py"))
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ParserError, match="RuntimeError: boom"):
        load_plugin(str(broken))
    with pytest.raises(ParserError, match="unknown tool-call parser 'nope'.*hermes"):
        tool_call_format("nope")
    with pytest.raises(ParserError, match="unknown reasoning parser 'nope'.*qwen3"):
        reasoning_format("nope")
