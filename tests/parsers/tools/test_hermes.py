"""hermes (Qwen2.5 / Qwen3 / Hermes): `<tool_call>{json}</tool_call>`, on canned outputs of those models."""

from __future__ import annotations

from sonar.parsers.tools import tool_call_format
from tests.parsers.streaming import args, check_both_ways

QWEN25_TWO_CALLS = (
    "<tool_call>\n"
    '{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA", "unit": "celsius"}}\n'
    "</tool_call>\n"
    "<tool_call>\n"
    '{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, USA", '
    '"date": "2024-10-01", "unit": "celsius"}}\n'
    "</tool_call>"
)

QWEN3_AFTER_TEXT = (
    "I'll look up the weather in Paris for you.\n\n"
    "<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "detail": {"hourly": true, "units": ["C"]}}}\n'
    "</tool_call>"
)


def test_qwen25_parallel_calls() -> None:
    content, calls = check_both_ways(tool_call_format("hermes"), QWEN25_TWO_CALLS)
    assert content is None
    assert [name for name, _ in calls] == ["get_current_temperature", "get_temperature_date"]
    assert args(calls[0][1]) == {"location": "San Francisco, CA, USA", "unit": "celsius"}
    assert args(calls[1][1])["date"] == "2024-10-01"


def test_qwen3_content_before_the_call_is_kept() -> None:
    content, calls = check_both_ways(tool_call_format("hermes"), QWEN3_AFTER_TEXT)
    assert content == "I'll look up the weather in Paris for you."
    assert calls == [("get_weather", '{"city": "Paris", "days": 3, "detail": {"hourly": true, "units": ["C"]}}')]


def test_text_after_the_call_and_arguments_before_the_name() -> None:
    text = '<tool_call>{"arguments": {"q": "}{"}, "name": "search"}</tool_call> Done.'
    content, calls = check_both_ways(tool_call_format("hermes"), text)
    assert content == "Done."
    assert calls == [("search", '{"q": "}{"}')]


def test_plain_text_and_look_alikes_stay_content() -> None:
    fmt = tool_call_format("hermes")
    assert check_both_ways(fmt, "The tag <tool is not a call.") == ("The tag <tool is not a call.", [])
    assert check_both_ways(fmt, "<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert check_both_ways(fmt, '<tool_call>{"city": "Paris"}</tool_call>')[1] == []
    assert check_both_ways(fmt, "   ") == (None, [])


def test_a_call_without_arguments_takes_none() -> None:
    assert check_both_ways(tool_call_format("hermes"), '<tool_call>{"name": "now"}</tool_call>') == (
        None,
        [("now", "{}")],
    )


def test_a_call_cut_short_keeps_what_was_written() -> None:
    fmt = tool_call_format("hermes")
    # max_tokens ended it inside the arguments: the call is there, its arguments incomplete.
    assert check_both_ways(fmt, '<tool_call>\n{"name": "f", "arguments": {"a": "x')[1] == [("f", '{"a": "x')]
    # ... or before the name was whole: nothing was a call yet, so it is content.
    assert check_both_ways(fmt, '<tool_call>\n{"name": "ge') == ('<tool_call>\n{"name": "ge', [])
