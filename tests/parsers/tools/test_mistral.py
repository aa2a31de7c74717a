"""mistral: `[TOOL_CALLS]` then a JSON array (Mistral 7B v0.3, Mixtral) or `name[ARGS]{...}` (v11+ tokenizers)."""

from __future__ import annotations

from sonar.parsers.tools import tool_call_format
from tests.parsers.streaming import args, check_both_ways

MISTRAL_V03 = (
    '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", "format": "celsius"}}, '
    '{"name": "get_current_weather", "arguments": {"location": "Rome, Italy", "format": "celsius"}}]'
)
MISTRAL_SMALL_32 = (
    '[TOOL_CALLS]get_current_weather[ARGS]{"location": "Paris, France", "format": "celsius"}'
    '[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}'
)


def test_json_array_form() -> None:
    content, calls = check_both_ways(tool_call_format("mistral"), MISTRAL_V03)
    assert content is None
    assert [args(a)["location"] for _, a in calls] == ["Paris, France", "Rome, Italy"]
    assert {name for name, _ in calls} == {"get_current_weather"}


def test_name_args_form() -> None:
    content, calls = check_both_ways(tool_call_format("mistral"), MISTRAL_SMALL_32)
    assert content is None
    assert calls == [
        ("get_current_weather", '{"location": "Paris, France", "format": "celsius"}'),
        ("get_time", '{"zone": "CET"}'),
    ]


def test_content_before_the_marker() -> None:
    text = 'Let me check that. [TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}'
    assert check_both_ways(tool_call_format("mistral"), text) == (
        "Let me check that.",
        [("get_time", '{"zone": "UTC"}')],
    )


def test_no_marker_is_content() -> None:
    fmt = tool_call_format("mistral")
    assert check_both_ways(fmt, "[1, 2, 3] are numbers") == ("[1, 2, 3] are numbers", [])
    assert check_both_ways(fmt, "[TOOL_CALLS] nothing") == ("[TOOL_CALLS] nothing", [])
