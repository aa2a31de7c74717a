"""The tool-call and reasoning parser flags: names checked at startup (exit 2), plugins loaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from sonar.cli import parse_serve_args
from sonar.cli.serve import _settings, describe, main

PLUGIN = """
from sonar.parsers.reasoning import ReasoningFormat, register_reasoning_parser
from sonar.parsers.tools import Call, Text, ToolCallFormat, register_tool_parser


@register_tool_parser("cli_test_tools")
class Never(ToolCallFormat):
    def scan(self, text, final):
        return [Text(text)]


@register_reasoning_parser("cli_test_reasoning")
class Angle(ReasoningFormat):
    starts = ("<<",)
    ends = (">>",)
"""


def test_the_flags_reach_the_server_settings() -> None:
    config = parse_serve_args(
        ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]
    )
    settings = _settings(config)
    assert (settings.enable_auto_tool_choice, settings.tool_call_parser, settings.reasoning_parser) == (
        True,
        "hermes",
        "qwen3",
    )
    assert {"tool calls: tool_choice 'auto' parsed with hermes", "reasoning parser: qwen3"} <= set(describe(config))
    plain = _settings(parse_serve_args([]))
    assert (plain.enable_auto_tool_choice, plain.tool_call_parser, plain.reasoning_parser) == (False, None, None)


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "pythonic", "qwen3_xml"])
def test_every_implemented_tool_parser_is_accepted(name: str) -> None:
    assert parse_serve_args(["--enable-auto-tool-choice", "--tool-call-parser", name]).tool_call_parser == name


def test_auto_tool_choice_needs_a_parser(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--enable-auto-tool-choice"]) == 2
    err = capsys.readouterr().err
    assert "--enable-auto-tool-choice: needs --tool-call-parser" in err and "hermes" in err


def test_a_parser_without_auto_tool_choice_is_refused(usage_error) -> None:
    assert "takes effect only with --enable-auto-tool-choice" in usage_error("--tool-call-parser", "hermes")


def test_documented_parsers_sonar_lacks_are_refused_naming_the_implemented(usage_error) -> None:
    message = usage_error("--enable-auto-tool-choice", "--tool-call-parser", "kimi_k2")
    assert message.startswith("sonar serve: --tool-call-parser is not supported yet (got kimi_k2;")
    assert "hermes, llama3_json, mistral, pythonic, qwen3_xml" in message


def test_unknown_names_are_refused(usage_error) -> None:
    assert "unknown parser 'nope'" in usage_error("--enable-auto-tool-choice", "--tool-call-parser", "nope")
    assert "unknown parser 'nope'" in usage_error("--reasoning-parser", "nope")
    assert "deepseek_r1, granite, qwen3" in usage_error("--reasoning-parser", "nope")


def test_plugins_register_names(tmp_path: Path, usage_error) -> None:
    plugin = tmp_path / "parsers.py"
    plugin.write_text(PLUGIN)
    config = parse_serve_args(
        [
            "--enable-auto-tool-choice",
            "--tool-parser-plugin",
            str(plugin),
            "--tool-call-parser",
            "cli_test_tools",
            "--reasoning-parser-plugin",
            str(plugin),
            "--reasoning-parser",
            "cli_test_reasoning",
        ]
    )
    assert (config.tool_call_parser, config.reasoning_parser) == ("cli_test_tools", "cli_test_reasoning")
    assert "no such file" in usage_error("--tool-parser-plugin", str(tmp_path / "absent.py"))


def test_the_reasoning_parser_is_one_setting_with_the_structured_outputs_configs(tmp_path: Path, usage_error) -> None:
    # --reasoning-parser reaches the engine (a request's grammar waits for the thinking) ...
    engine = parse_serve_args(["--reasoning-parser", "qwen3"]).engine
    assert engine.structured_config().reasoning_parser == "qwen3"
    assert engine.structured_config().thinking_ends() == ("</think>",)
    # ... and the config's key reaches the HTTP frontend (reasoning_content), plugin included
    plugin = tmp_path / "parsers.py"
    plugin.write_text(PLUGIN)
    config = parse_serve_args(
        [
            "--structured-outputs-config",
            f'{{"reasoning_parser": "cli_test_reasoning", "reasoning_parser_plugin": "{plugin}"}}',
        ]
    )
    assert (config.reasoning_parser, config.reasoning_parser_plugin) == ("cli_test_reasoning", str(plugin))
    assert _settings(config).reasoning_parser == "cli_test_reasoning"
    assert config.engine.structured_config().thinking_ends() == (">>",)
    same = parse_serve_args(["--reasoning-parser", "qwen3", "--structured-outputs-config.reasoning_parser", "qwen3"])
    assert same.reasoning_parser == same.engine.structured_config().reasoning_parser == "qwen3"
    inside = parse_serve_args(
        ["--reasoning-parser", "qwen3", "--structured-outputs-config.enable_in_reasoning", "true"]
    )
    assert inside.reasoning_parser == "qwen3" and inside.engine.structured_config().thinking_ends() == ()
    message = usage_error("--reasoning-parser", "qwen3", "--structured-outputs-config.reasoning_parser", "granite")
    assert "--reasoning-parser" in message and "--structured-outputs-config.reasoning_parser" in message, message
    assert "'qwen3'" in message and "'granite'" in message, message
    assert "unknown parser 'nope'" in usage_error("--structured-outputs-config.reasoning_parser", "nope")
