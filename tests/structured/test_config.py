"""`--structured-outputs-config`: what it takes and what it refuses, by name."""

from __future__ import annotations

import pytest

from sonar.structured import StructuredOutputsConfig


def test_the_config_refuses_what_it_does_not_know() -> None:
    assert StructuredOutputsConfig.parse({"backend": "xgrammar", "reasoning_parser": ""}).backend == "xgrammar"
    for raw, message in (
        ({"backend": "outlines"}, "backend='outlines'"),
        ({"speed": 1}, "unknown key(s) speed"),
        ({"reasoning_parser": "deepseek_r1"}, "reasoning_parser='deepseek_r1' is not supported"),
        ({"disable_any_whitespace": "maybe"}, "disable_any_whitespace"),
    ):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            StructuredOutputsConfig.parse(raw)
