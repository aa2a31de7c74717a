"""A response's output items (`sonar.http.responses_output`) from real output parsers (hermes tool
calls, qwen3 thinking) as plain values: the items of a text fed whole equal those of the same text
fed in pieces, and the stream events of the pieces rebuild them."""

from __future__ import annotations

import itertools
from typing import Any

import msgspec

from sonar.http.responses_output import OutputItems
from sonar.http.responses_protocol import FunctionCallOutput, OutputMessage, ReasoningOutput
from sonar.http.settings import ServerSettings
from sonar.http.tools import ChoicePiece, ToolPlan, choice_output

SETTINGS = ServerSettings(("m",), enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3")
PLAN = ToolPlan("auto", {"get_weather": {"type": "object"}}, parser="hermes")
TEXT = (
    "<think>They ask for the weather.</think>\n\nChecking.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
)


def numbered() -> Any:
    counter = itertools.count()
    return lambda prefix: f"{prefix}_{next(counter)}"


def shape(items: list[Any]) -> list[Any]:
    return [{k: v for k, v in msgspec.to_builtins(item).items() if k not in ("id", "call_id")} for item in items]


def fed(pieces: list[str], status: str = "completed") -> tuple[OutputItems, list[tuple[str, dict[str, Any]]]]:
    parser = choice_output(PLAN, SETTINGS, "")
    assert parser is not None
    items = OutputItems(numbered())
    events = []
    for i, text in enumerate(pieces):
        events += items.feed(parser.step(text, last=i == len(pieces) - 1))
    events += items.finish(status)
    return items, [(kind.__struct_config__.tag, fields) for kind, fields in events]


def test_reasoning_message_and_calls_in_order() -> None:
    items, _ = fed([TEXT])
    reasoning, message, paris, rome = items.items
    assert isinstance(reasoning, ReasoningOutput) and reasoning.content[0].text == "They ask for the weather."
    assert isinstance(message, OutputMessage) and message.content[0].text == "Checking."
    assert isinstance(paris, FunctionCallOutput) and isinstance(rome, FunctionCallOutput)
    assert (paris.name, paris.arguments, rome.arguments) == ("get_weather", '{"city": "Paris"}', '{"city": "Rome"}')
    assert paris.call_id.startswith("call_") and paris.call_id != rome.call_id
    assert [i.status for i in items.items] == ["completed"] * 4


def test_pieces_give_the_whole_items_and_their_events_rebuild_them() -> None:
    whole, _ = fed([TEXT])
    items, events = fed([TEXT[i : i + 3] for i in range(0, len(TEXT), 3)])
    assert shape(items.items) == shape(whole.items)
    rebuilt: dict[int, dict[str, Any]] = {}
    for kind, fields in events:
        if kind == "response.output_item.added":
            rebuilt[fields["output_index"]] = msgspec.to_builtins(fields["item"])
        elif kind == "response.content_part.added":
            rebuilt[fields["output_index"]]["content"].append(msgspec.to_builtins(fields["part"]))
        elif kind in ("response.output_text.delta", "response.reasoning_text.delta"):
            rebuilt[fields["output_index"]]["content"][0]["text"] += fields["delta"]
        elif kind == "response.function_call_arguments.delta":
            rebuilt[fields["output_index"]]["arguments"] += fields["delta"]
        elif kind == "response.output_item.done":
            done = msgspec.to_builtins(fields["item"])
            rebuilt[fields["output_index"]]["status"] = done["status"]
            assert rebuilt[fields["output_index"]] == done
    assert [rebuilt[i] for i in sorted(rebuilt)] == msgspec.to_builtins(items.items)
    # Each item closes before the next opens.
    opened = [f["output_index"] for k, f in events if k == "response.output_item.added"]
    closed = [f["output_index"] for k, f in events if k == "response.output_item.done"]
    assert opened == closed == [0, 1, 2, 3]


def test_a_cut_call_is_incomplete_and_nothing_is_an_empty_message() -> None:
    items, _ = fed([TEXT[:-30]], status="incomplete")
    assert [i.status for i in items.items] == ["completed", "completed", "completed", "incomplete"]
    empty = OutputItems(numbered())
    events = empty.feed(ChoicePiece()) + empty.finish("completed")
    [message] = empty.items
    assert isinstance(message, OutputMessage) and message.content[0].text == "" and message.status == "completed"
    assert [kind.__struct_config__.tag for kind, _ in events] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
