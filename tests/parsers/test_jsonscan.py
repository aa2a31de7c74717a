"""Finding JSON values in text still arriving: complete, incomplete (more may come), invalid."""

from __future__ import annotations

import time

import pytest

from sonar.parsers.jsonscan import Incomplete, Invalid, Member, object_members, value_end
from sonar.parsers.tools import ToolCallStream, tool_call_format


@pytest.mark.parametrize(
    "text",
    ['{"a": [1, {"b": "}]\\""}]}', '"x\\\\"', "[]", "-1.5e3", "true", '{"k": "ä \\u00e9"}'],
)
def test_complete_values_end_where_they_end(text: str) -> None:
    assert value_end(text + " tail", 0, final=False) == len(text)


@pytest.mark.parametrize("text", ['{"a": [1, 2', '"abc\\"', '{"a": "}', "12", "tru"])
def test_values_cut_short_are_incomplete(text: str) -> None:
    with pytest.raises(Incomplete):
        value_end(text, 0, final=False)


@pytest.mark.parametrize("text", ['{"a": 1]', "[1, 2}", "{'a': 1}", "nope ", "{a: 1}"])
def test_non_json_is_invalid(text: str) -> None:
    with pytest.raises(Invalid):
        value_end(text, 0, final=True)


def test_object_members_as_far_as_the_text_goes() -> None:
    text = '{"name": "f", "arguments": {"x": [1, 2'
    members, end = object_members(text, 0, final=False)
    assert end is None
    assert members == [Member("name", 9, 12), Member("arguments", 27, None)]
    members, end = object_members(text + "]}}", 0, final=False)
    assert end == len(text) + 3 and members[1].end == len(text) + 2


def test_streaming_a_long_call_stays_fast() -> None:
    """A stream rescans its text after every delta: 8 KB of arguments in 2-character deltas."""
    arguments = '{"code": "' + "x = 1\\n" * 1150 + '"}'
    text = f'<tool_call>{{"name": "run", "arguments": {arguments}}}</tool_call>'
    stream = ToolCallStream(tool_call_format("hermes"))
    started = time.perf_counter()
    got = "".join(d.arguments or "" for i in range(0, len(text), 2) for d in stream.feed(text[i : i + 2]).calls)
    assert got == arguments
    assert time.perf_counter() - started < 5.0
