"""`--structured-outputs-config`: what it takes and what it refuses, by name."""

from __future__ import annotations

import pytest

from sonar.structured import StructuredOutputsConfig


def test_the_config_refuses_what_it_does_not_know() -> None:
    assert StructuredOutputsConfig.parse({"backend": "xgrammar", "reasoning_parser": ""}).backend == "xgrammar"
    for raw, message in (
        ({"backend": "outlines"}, "backend='outlines'"),
        ({"speed": 1}, "unknown key(s) speed"),
        ({"reasoning_parser": "nope"}, "reasoning_parser: unknown reasoning parser 'nope'"),
        ({"reasoning_parser_plugin": "/nonexistent/plugin.py"}, "reasoning_parser_plugin: parser plugin"),
        ({"enable_in_reasoning": "yes"}, "enable_in_reasoning"),
        ({"disable_any_whitespace": "maybe"}, "disable_any_whitespace"),
    ):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            StructuredOutputsConfig.parse(raw)


def test_the_engine_takes_it_as_json_or_a_dict_and_refuses_bad_keys_at_startup() -> None:
    from sonar.engine.config import EngineConfig

    config = EngineConfig.from_args(None, structured_outputs_config='{"backend": "guidance"}')
    assert config.structured_config().backend == "guidance"
    assert (
        EngineConfig.from_args(None, structured_outputs_config={"disable_any_whitespace": True})
        .structured_config()
        .disable_any_whitespace
    )
    with pytest.raises(ValueError, match=r"unknown key\(s\) strict"):
        EngineConfig.from_args(None, structured_outputs_config={"strict": True})
    with pytest.raises(ValueError, match="structured_outputs_compile_timeout"):
        EngineConfig.from_args(None, structured_outputs_compile_timeout=0)


def test_a_reasoning_parser_names_where_the_grammar_starts() -> None:
    assert StructuredOutputsConfig.parse({}).thinking_ends() == ()
    assert StructuredOutputsConfig.parse({"reasoning_parser": None}).thinking_ends() == ()
    assert StructuredOutputsConfig.parse({"reasoning_parser": "deepseek_r1"}).thinking_ends() == ("</think>",)
    granite = StructuredOutputsConfig.parse({"reasoning_parser": "granite"})
    assert granite.thinking_ends() == ("Here is my response:", "Here's my response:")
    inside = StructuredOutputsConfig.parse({"reasoning_parser": "qwen3", "enable_in_reasoning": True})
    assert inside.thinking_ends() == ()
