"""llama3_json (Llama 3.1 / 3.2 / 3.3): JSON calls with `parameters`, `<|python_tag|>` optional, `;` between."""

from __future__ import annotations

from sonar.parsers.tools import tool_call_format
from tests.parsers.streaming import args, check_both_ways

LLAMA31 = '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", "unit": "Fahrenheit"}}'
LLAMA32_TWO = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Tokyo"}}; '
    '{"name": "get_time", "parameters": {"timezone": "Asia/Tokyo"}}'
)


def test_llama31_single_call() -> None:
    content, calls = check_both_ways(tool_call_format("llama3_json"), LLAMA31)
    assert content is None
    assert calls[0][0] == "get_current_conditions"
    assert args(calls[0][1]) == {"location": "San Francisco, CA", "unit": "Fahrenheit"}


def test_python_tag_and_semicolons() -> None:
    content, calls = check_both_ways(tool_call_format("llama3_json"), LLAMA32_TWO)
    assert content is None
    assert calls == [("get_weather", '{"city": "Tokyo"}'), ("get_time", '{"timezone": "Asia/Tokyo"}')]


def test_arguments_key_is_accepted_too() -> None:
    assert check_both_ways(tool_call_format("llama3_json"), '{"name": "f", "arguments": {"x": [1, 2]}}')[1] == [
        ("f", '{"x": [1, 2]}')
    ]


def test_answers_are_content() -> None:
    fmt = tool_call_format("llama3_json")
    assert check_both_ways(fmt, "The capital of France is Paris.") == ("The capital of France is Paris.", [])
    assert check_both_ways(fmt, '{"answer": 42}') == ('{"answer": 42}', [])
    assert check_both_ways(fmt, 'Call {"name": "f", "parameters": {}}') == ('Call {"name": "f", "parameters": {}}', [])


def test_text_after_the_calls_is_content() -> None:
    text = '{"name": "f", "parameters": {"a": 1}} I called f.'
    assert check_both_ways(tool_call_format("llama3_json"), text) == ("I called f.", [("f", '{"a": 1}')])
