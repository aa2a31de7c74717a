"""pythonic (Llama 3.2, Llama 4): `[f(a=1), g(b="x")]`, read with `ast`, never evaluated."""

from __future__ import annotations

from sonar.parsers.tools import tool_call_format
from tests.parsers.streaming import args, check_both_ways

LLAMA32 = "[get_weather(city='San Francisco', metric='celsius'), get_time(timezone=\"PST\")]"
LLAMA4 = '<|python_start|>[search(query="best ramen, Tokyo", filters={"open": True, "price": [1, 2]}, limit=5)]<|python_end|>'


def test_llama32_two_calls() -> None:
    content, calls = check_both_ways(tool_call_format("pythonic"), LLAMA32)
    assert content is None
    assert calls == [
        ("get_weather", '{"city": "San Francisco", "metric": "celsius"}'),
        ("get_time", '{"timezone": "PST"}'),
    ]


def test_llama4_tags_and_nested_literals() -> None:
    content, calls = check_both_ways(tool_call_format("pythonic"), LLAMA4)
    assert content is None
    assert calls[0][0] == "search"
    assert args(calls[0][1]) == {"query": "best ramen, Tokyo", "filters": {"open": True, "price": [1, 2]}, "limit": 5}


def test_no_arguments_and_text_after() -> None:
    assert check_both_ways(tool_call_format("pythonic"), "[now()]\nChecking the time.") == (
        "Checking the time.",
        [("now", "{}")],
    )


def test_nothing_is_evaluated() -> None:
    fmt = tool_call_format("pythonic")
    for text in (
        "[__import__('os').system('touch /tmp/sonar-pwned')]",
        "[f(a=open('/etc/passwd').read())]",
        "[f(x=1 + 2)]",
        "[f(**{'a': 1})]",
        "[f(1, 2)]",
        "[x for x in range(3)]",
        "[1, 2, 3]",
        "[]",
        "Sure, [here] it is.",
    ):
        assert check_both_ways(fmt, text) == (text, []), text


def test_a_list_cut_short_keeps_its_whole_calls() -> None:
    fmt = tool_call_format("pythonic")
    assert check_both_ways(fmt, "[now(), get_weather(city='Par") == (None, [("now", "{}")])
    assert check_both_ways(fmt, "[get_weather(city='Par") == ("[get_weather(city='Par", [])
