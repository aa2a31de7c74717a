"""A response's output items, built from what a choice's output parser (`sonar.http.tools`) makes
of the generated text, together with the stream events that build them.

The thinking becomes a `reasoning` item (its text as one `reasoning_text` content part, no
summary), the answer a `message` item (one `output_text` part), each tool call a
`function_call` item. Items open as their text starts and close when another kind begins, so a
stream sends, per item: response.output_item.added, its content part's `added` (reasoning and
message), its deltas (response.reasoning_text.delta, response.output_text.delta,
response.function_call_arguments.delta), then the `done` events and response.output_item.done.

The whole response is the same builder fed the whole text at once: its items are those a stream
of the same text ends with. An output with no item at all (nothing generated) is one empty
message. The last item takes the response's fate (`incomplete` when the token limit cut it); the
ones closed before it are `completed`.
"""

from __future__ import annotations

import secrets
from typing import Any, Callable, Iterable

import msgspec

from sonar.http.protocol import DeltaFunctionCall
from sonar.http.responses_protocol import (
    ContentPartAdded,
    ContentPartDone,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    FunctionCallOutput,
    Logprob,
    OutputItem,
    OutputItemAdded,
    OutputItemDone,
    OutputMessage,
    OutputText,
    OutputTextDelta,
    OutputTextDone,
    ReasoningOutput,
    ReasoningText,
    ReasoningTextDelta,
    ReasoningTextDone,
    StreamEvent,
)
from sonar.http.tools import ChoicePiece

#: A stream event to send: its type and its fields but the sequence number.
Event = tuple[type[StreamEvent], dict[str, Any]]


def new_id(prefix: str) -> str:
    """OpenAI's id form for the Responses API: `resp_<hex>`, `msg_<hex>`, `fc_<hex>`, `rs_<hex>`."""
    return f"{prefix}_{secrets.token_hex(16)}"


class OutputItems:
    """The output items of one response, grown piece by piece (`feed`) and closed by `finish`."""

    def __init__(self, make_id: Callable[[str], str] = new_id) -> None:
        self.items: list[OutputItem] = []
        self._make_id = make_id
        self._open: int | None = None
        #: A tool call's index (in the parser's deltas) → its item's output index.
        self._calls: dict[int, int] = {}

    def feed(self, piece: ChoicePiece, logprobs: Iterable[Logprob] = ()) -> list[Event]:
        """The events of what `piece` adds (`logprobs`: the output text's, plain text only)."""
        events: list[Event] = []
        logprobs = list(logprobs)
        if piece.reasoning:
            index, reasoning = self._into(ReasoningOutput, events)
            assert isinstance(reasoning, ReasoningOutput)
            reasoning.content[0].text += piece.reasoning
            fields = dict(item_id=reasoning.id, output_index=index, content_index=0, delta=piece.reasoning)
            events.append((ReasoningTextDelta, fields))
        if piece.content or logprobs:
            index, message = self._into(OutputMessage, events)
            assert isinstance(message, OutputMessage)
            part = message.content[0]
            part.text += piece.content
            part.logprobs.extend(logprobs)
            fields = dict(item_id=message.id, output_index=index, content_index=0, delta=piece.content)
            events.append((OutputTextDelta, {**fields, "logprobs": logprobs}))
        for call in piece.calls:
            function = call.function or DeltaFunctionCall()
            if call.id is not None:  # a new call: its id and name
                self._close("completed", events)
                item = FunctionCallOutput(self._make_id("fc"), call.id, function.name or "", "", "in_progress")
                self._open = self._calls[call.index] = len(self.items)
                self.items.append(item)
                events.append((OutputItemAdded, dict(output_index=self._open, item=_copy(item))))
            if function.arguments:
                index = self._calls[call.index]
                item = self.items[index]
                assert isinstance(item, FunctionCallOutput)
                item.arguments += function.arguments
                events.append(
                    (FunctionCallArgumentsDelta, dict(item_id=item.id, output_index=index, delta=function.arguments))
                )
        return events

    def finish(self, status: str) -> list[Event]:
        """Close the last item with `status` (completed or incomplete); nothing generated is one
        empty message."""
        events: list[Event] = []
        if not self.items:
            self._into(OutputMessage, events)
        self._close(status, events)
        return events

    def _into(self, kind: type[ReasoningOutput] | type[OutputMessage], events: list[Event]) -> tuple[int, OutputItem]:
        """The open item if it is a `kind`, else a new one (the open one closed first)."""
        if self._open is not None and isinstance(self.items[self._open], kind):
            return self._open, self.items[self._open]
        self._close("completed", events)
        index = len(self.items)
        item: OutputItem
        part: OutputText | ReasoningText
        if kind is OutputMessage:
            item, part = OutputMessage(self._make_id("msg"), "in_progress", []), OutputText("")
        else:
            item, part = ReasoningOutput(self._make_id("rs"), "in_progress", []), ReasoningText("")
        events.append((OutputItemAdded, dict(output_index=index, item=_copy(item))))
        events.append((ContentPartAdded, dict(item_id=item.id, output_index=index, content_index=0, part=_copy(part))))
        item.content.append(part)  # type: ignore[arg-type]
        self.items.append(item)
        self._open = index
        return index, item

    def _close(self, status: str, events: list[Event]) -> None:
        if self._open is None:
            return
        index, item = self._open, self.items[self._open]
        self._open = None
        item.status = status
        if isinstance(item, FunctionCallOutput):
            events.append(
                (FunctionCallArgumentsDone, dict(item_id=item.id, output_index=index, arguments=item.arguments))
            )
        else:
            part = item.content[0]
            ids = dict(item_id=item.id, output_index=index, content_index=0)
            if isinstance(part, OutputText):
                events.append((OutputTextDone, dict(ids, text=part.text, logprobs=list(part.logprobs))))
            else:
                events.append((ReasoningTextDone, dict(ids, text=part.text)))
            events.append((ContentPartDone, dict(ids, part=_copy(part))))
        events.append((OutputItemDone, dict(output_index=index, item=_copy(item))))


def _copy(value: Any) -> Any:
    """A deep copy: an event shows the item as it was when the event was made."""
    return msgspec.convert(msgspec.to_builtins(value), type(value))
