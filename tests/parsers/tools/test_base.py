"""The driver: ids, deltas in OpenAI's order, and a randomized check that for every format and any
text a stream (in any pieces) hands out exactly the whole-text result, and never raises."""

from __future__ import annotations

import random

import pytest

from sonar.parsers.tools import BUILTIN_TOOL_PARSERS, ToolCallStream, tool_call_format
from sonar.parsers.tools.base import new_call_id
from tests.parsers.streaming import check_both_ways

FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "<|python_tag|>",
    "[TOOL_CALLS]",
    "[ARGS]",
    "<function=f>",
    "</function>",
    "<parameter=a>",
    "</parameter>",
    '{"name": "f", "arguments": {"a": 1}}',
    '{"name": "g", "parameters": {"b": "x}"}}',
    '{"name": ',
    '"f"',
    "}",
    "{",
    "[",
    "]",
    "f(a=1)",
    "g(b='y')",
    ", ",
    "; ",
    "\n",
    " ",
    "hello",
    '"',
    "\\",
    "<",
    "2",
]


def test_call_ids_are_openai_shaped_and_distinct() -> None:
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(i.startswith("call_") and len(i) == 29 and i[5:].isalnum() for i in ids)


def test_a_call_is_announced_once_then_its_arguments_grow() -> None:
    s = ToolCallStream(tool_call_format("hermes"))
    first = s.feed('<tool_call>{"name": "f", "arguments": {"a": ')
    assert [(d.index, d.name, d.arguments) for d in first.calls] == [(0, "f", None), (0, None, '{"a": ')]
    assert first.calls[0].id is not None
    later = s.feed("1}}</tool_call>")
    assert [(d.index, d.id, d.arguments) for d in later.calls] == [(0, None, "1}")]
    assert s.finish().calls == [] and s.calls_made == 1


@pytest.mark.parametrize("name", BUILTIN_TOOL_PARSERS)
def test_random_texts_stream_as_they_parse(name: str) -> None:
    rng = random.Random(name)
    fmt = tool_call_format(name, {"f": {"properties": {"a": {"type": "integer"}}}})
    for _ in range(300):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 12)))
        check_both_ways(fmt, text, seeds=3)
