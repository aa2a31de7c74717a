"""Tool calls and reasoning in chat completions: what a request's `tool_choice` asks for, and the
generated text turned into the response message (whole) or its stream deltas.

* `none` (the default without tools): the output is content.
* `auto` (the default with tools): needs --enable-auto-tool-choice and --tool-call-parser; the
  output is parsed with that parser into content and `tool_calls`.
* `required` and a named function are enforced with structured outputs: the output must be a
  JSON array of `{"name", "parameters"}` (one element with `parallel_tool_calls: false`), or the
  named function's arguments object; that JSON becomes `tool_calls`.

With --reasoning-parser the thinking is split off first (`reasoning_content`, and `reasoning`,
the same text); the tool calls are read from the answer after it. The engine applies the
structured outputs of `required` and named functions after the thinking too
(`sonar.core.thinking`), so the answer is the constrained JSON. A choice that made calls and
stopped on its own finishes with `tool_calls`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from sonar.http.messages import tool_choice_of
from sonar.http.protocol import (
    ChatCompletionRequest,
    ChatTool,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    RequestError,
    ResponseMessage,
    ToolCall,
)
from sonar.http.settings import ServerSettings
from sonar.parsers.reasoning import ReasoningFormat, ReasoningStream, reasoning_format
from sonar.parsers.tools import ToolCallFormat, ToolCallStream, tool_call_format
from sonar.parsers.tools.json_list import JsonListFormat, NamedFunctionFormat
from sonar.sampling_params import SamplingParams, StructuredOutputsParams

#: The parameters schema of a function that declares none: any object.
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools and tool_choice ask for: `mode` is none, auto, required or named."""

    mode: str
    #: Each tool's name and its parameters' JSON schema, in the request's order.
    tools: dict[str, dict[str, Any]] = field(default_factory=dict)
    function: str | None = None
    parallel: bool = True
    parser: str | None = None

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must follow (required, named), else None."""
        if self.mode == "named":
            return self.tools[self.function or ""]
        if self.mode != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, parameters in self.tools.items()
        ]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    def constrain(self, params: SamplingParams, skip_special_tokens: bool | None = None) -> None:
        """Enforce required / named with structured outputs; keep the special tokens a parser
        reads (unless the request says whether to skip them: `skip_special_tokens`)."""
        if self.mode == "auto" and skip_special_tokens is None:
            fmt = self.output_format()
            if fmt is not None and fmt.keeps_special_tokens:
                params.skip_special_tokens = False
        schema = self.schema()
        if schema is None:
            return
        if params.structured_outputs is not None:
            raise RequestError(
                f"tool_choice {self.mode!r} constrains the output itself; it cannot be combined with another "
                "output constraint (response_format, structured_outputs, text.format)",
                "tool_choice",
            )
        params.structured_outputs = StructuredOutputsParams(json=schema)

    def output_format(self) -> ToolCallFormat | None:
        if self.mode == "auto":
            return tool_call_format(self.parser or "", self.tools)
        if self.mode == "required":
            return JsonListFormat(self.tools)
        if self.mode == "named":
            return NamedFunctionFormat(self.function or "")
        return None


def plan_tools(req: ChatCompletionRequest, settings: ServerSettings) -> ToolPlan:
    """A chat request's tool plan (see `tool_plan`)."""
    return tool_plan(req.tool_choice, req.tools, req.parallel_tool_calls, settings)


def tool_plan(
    tool_choice: str | NamedToolChoice | None,
    tools: Sequence[ChatTool] | None,
    parallel_tool_calls: bool | None,
    settings: ServerSettings,
) -> ToolPlan:
    """The tool plan of a request's tools and tool_choice (checked by `tool_choice_of`; the tools'
    names and types by `template_tools`), for chat completions and responses alike; an "auto"
    the server cannot honour is a 400 naming tool_choice."""
    choice = tool_choice_of(tool_choice, tools)
    parameters = {tool.function.name: tool.function.parameters or dict(ANY_OBJECT) for tool in tools or []}
    parallel = parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice):
        return ToolPlan("named", parameters, choice.function.name, parallel)
    if choice == "auto" and not (settings.enable_auto_tool_choice and settings.tool_call_parser):
        raise RequestError(
            "tool_choice 'auto' needs the server started with --enable-auto-tool-choice and --tool-call-parser "
            "(or use tool_choice 'required', 'none' or a named function)",
            "tool_choice",
        )
    return ToolPlan(choice, parameters, None, parallel, settings.tool_call_parser if choice == "auto" else None)


@dataclass
class ChoicePiece:
    reasoning: str = ""
    content: str = ""
    calls: list[DeltaToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


class ChoiceOutput:
    """One choice's generated text through the reasoning parser, then the tool-call format (either
    may be absent: the text then passes as it is)."""

    def __init__(self, tools: ToolCallFormat | None, reasoning: ReasoningFormat | None, opened: bool) -> None:
        self._reasoning = ReasoningStream(reasoning, opened) if reasoning is not None else None
        self._tools = ToolCallStream(tools) if tools is not None else None

    @property
    def calls_made(self) -> int:
        return self._tools.calls_made if self._tools is not None else 0

    def step(self, text: str, last: bool) -> ChoicePiece:
        """What the next `text` of the output adds (`last`: the output ends with it)."""
        reasoning, content = "", text
        if self._reasoning is not None:
            reasoning, content = self._reasoning.feed(text)
            if last:
                more_reasoning, more_content = self._reasoning.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        if self._tools is None:
            return ChoicePiece(reasoning, content)
        grown = self._tools.feed(content)
        calls_grown = list(grown.calls)
        content = grown.content
        if last:
            done = self._tools.finish()
            calls_grown.extend(done.calls)
            content += done.content
        calls = [
            DeltaToolCall(
                d.index,
                d.id,
                "function" if d.id is not None else None,
                DeltaFunctionCall(d.name, d.arguments),
            )
            for d in calls_grown
        ]
        return ChoicePiece(reasoning, content, calls)

    def delta(self, piece: ChoicePiece) -> DeltaMessage:
        """A stream delta of `piece` (reasoning in both of its fields)."""
        return DeltaMessage(
            content=piece.content or None,
            tool_calls=piece.calls or None,
            reasoning_content=piece.reasoning or None,
            reasoning=piece.reasoning or None,
        )


def finish_reason(reason: str | None, calls_made: int) -> str | None:
    """`tool_calls` for a choice that made calls and stopped on its own."""
    return "tool_calls" if calls_made and reason == "stop" else reason


def whole_message(output: ChoiceOutput, text: str, role: str) -> ResponseMessage:
    """The response message of a whole generated text (the sum of its stream deltas)."""
    piece = output.step(text, last=True)
    reasoning = piece.reasoning or None
    content = piece.content
    calls: dict[int, list[str]] = {}
    ids: dict[int, str] = {}
    for call in piece.calls:
        function = call.function or DeltaFunctionCall()
        if call.id is not None:
            ids[call.index] = call.id
            calls[call.index] = [function.name or "", ""]
        calls[call.index][1] += function.arguments or ""
    tool_calls = [
        ToolCall(id=ids[i], function=FunctionCall(name=n, arguments=a)) for i, (n, a) in sorted(calls.items())
    ]
    return ResponseMessage(
        role,
        content or (None if tool_calls else content),
        tool_calls or None,
        reasoning,
        reasoning,
    )


def choice_output(plan: ToolPlan, settings: ServerSettings, prompt_tail: str) -> ChoiceOutput | None:
    """The output parser of one choice (None when the text passes as it is)."""
    tools = plan.output_format()
    reasoning = reasoning_format(settings.reasoning_parser) if settings.reasoning_parser else None
    if reasoning is not None and reasoning.closed_by(prompt_tail):
        reasoning = None  # the prompt ended the thinking: the output is all answer
    if tools is None and reasoning is None:
        return None
    return ChoiceOutput(tools, reasoning, reasoning.opened_by(prompt_tail) if reasoning is not None else False)
