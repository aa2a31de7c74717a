"""The JSON of forced tool calls (tool_choice required / named), read as calls whole and streamed."""

from __future__ import annotations

from sonar.parsers.tools.json_list import JsonListFormat, NamedFunctionFormat
from tests.parsers.streaming import check_both_ways


def test_required_array() -> None:
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {"y": [true, null]}}]'
    assert check_both_ways(JsonListFormat(), text) == (None, [("a", '{"x": 1}'), ("b", '{"y": [true, null]}')])


def test_required_array_cut_short_keeps_what_it_has() -> None:
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {"y": '
    assert check_both_ways(JsonListFormat(), text)[1] == [("a", '{"x": 1}'), ("b", '{"y": ')]


def test_not_an_array_of_calls_is_content() -> None:
    for text in ('{"name": "a"}', "[1, 2]", "[]", "sorry"):
        assert check_both_ways(JsonListFormat(), text) == (text, [])


def test_named_function_output_is_its_arguments() -> None:
    assert check_both_ways(NamedFunctionFormat("f"), '\n{"city": "Paris"}\n') == (None, [("f", '{"city": "Paris"}')])
    assert check_both_ways(NamedFunctionFormat("f"), "") == (None, [("f", "{}")])
