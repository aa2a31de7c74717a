"""qwen3_xml (Qwen3-Coder): `<function=name><parameter=p>value</parameter></function>`, values typed by the schema."""

from __future__ import annotations

from sonar.parsers.tools import tool_call_format
from sonar.parsers.tools.qwen3_xml import convert
from tests.parsers.streaming import args, check_both_ways

TOOLS = {
    "run_tests": {
        "type": "object",
        "properties": {
            "path": {"type": "string"},
            "workers": {"type": "integer"},
            "timeout": {"type": "number"},
            "verbose": {"type": "boolean"},
            "markers": {"type": "array", "items": {"type": "string"}},
            "env": {"type": "object"},
        },
    }
}

QWEN3_CODER = (
    "I'll run the tests now.\n"
    "<tool_call>\n"
    "<function=run_tests>\n"
    "<parameter=path>\n"
    "tests/unit\n"
    "</parameter>\n"
    "<parameter=workers>\n"
    "4\n"
    "</parameter>\n"
    "<parameter=timeout>\n"
    "2.5\n"
    "</parameter>\n"
    "<parameter=verbose>\n"
    "True\n"
    "</parameter>\n"
    "<parameter=markers>\n"
    '["slow", "db"]\n'
    "</parameter>\n"
    "<parameter=env>\n"
    '{"CI": "1"}\n'
    "</parameter>\n"
    "</function>\n"
    "</tool_call>"
)


def test_qwen3_coder_call_typed_by_schema() -> None:
    content, calls = check_both_ways(tool_call_format("qwen3_xml", TOOLS), QWEN3_CODER)
    assert content == "I'll run the tests now."
    assert calls[0][0] == "run_tests"
    assert args(calls[0][1]) == {
        "path": "tests/unit",
        "workers": 4,
        "timeout": 2.5,
        "verbose": True,
        "markers": ["slow", "db"],
        "env": {"CI": "1"},
    }


def test_two_calls_multiline_string_and_no_parameters() -> None:
    text = (
        "<tool_call>\n<function=write_file>\n<parameter=content>\ndef f():\n    return 1\n</parameter>\n"
        "</function>\n</tool_call>\n<tool_call>\n<function=list_files>\n</function>\n</tool_call>"
    )
    tools = {"write_file": {"properties": {"content": {"type": "string"}}}}
    content, calls = check_both_ways(tool_call_format("qwen3_xml", tools), text)
    assert content is None
    assert calls == [("write_file", '{"content": "def f():\\n    return 1"}'), ("list_files", "{}")]


def test_values_without_a_schema_read_as_json_when_they_can() -> None:
    assert convert("\n12\n", None) == 12
    assert convert("\nhello world\n", None) == "hello world"
    assert convert("007", {"type": "string"}) == "007"
    assert convert("seven", {"type": "integer"}) == "seven"
    assert convert("null", {"type": ["integer", "null"]}) is None
    assert convert("3", {"type": "number"}) == 3


def test_a_call_cut_short_closes_with_the_parameters_it_has() -> None:
    text = "<tool_call>\n<function=run_tests>\n<parameter=workers>\n2\n</parameter>\n<parameter=path>\ntes"
    assert check_both_ways(tool_call_format("qwen3_xml", TOOLS), text)[1] == [("run_tests", '{"workers": 2}')]


def test_not_a_function_is_content() -> None:
    text = "<tool_call>\nhello\n</tool_call>"
    assert check_both_ways(tool_call_format("qwen3_xml"), text) == (text, [])
