"""Chat messages and tools as the chat template receives them, and the checks on them.

The template gets what transformers' `apply_chat_template` expects: each message a dict with
`role` and `content` (a string: text parts are joined with newlines, null content next to tool
calls is the empty string), plus `name`, `tool_calls` (`{"id", "type", "function": {"name",
"arguments"}}` with `arguments` parsed from the JSON text into a dict, as templates iterate it),
`tool_call_id` (tool messages) and `reasoning_content` where the message has them; `tools` is the
list of `{"type": "function", "function": {...}}` dicts.

Roles: system, developer, user, assistant, tool. A `developer` message (OpenAI's name for system
instructions) reaches the template as `system` unless the template itself mentions the developer
role: most open models' templates know only `system`, and would render an unknown role verbatim
or fail.

An ``image_url`` part (a model that takes images, `image_token` given) becomes the model's image
token in the text, where the part was, and its URL joins `images`; for any other model it is a
400 saying the model takes no images. An ``image_embeds`` part (an image given as its feature
rows, --enable-mm-embeds) does the same with its value, as an `EmbedsPart`, for the engine to
read (`sonar.engine.image_embeds`).

A wrong message is a 400 naming it (`messages[i].field`): an unknown role, null content on a
message other than an assistant's, tool calls on a message other than an assistant's, a tool
message without `tool_call_id`, arguments that are not a JSON object.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

import msgspec

from sonar.http.protocol import ChatMessage, ChatTool, NamedToolChoice, RequestError, TextPart, ToolCall

ROLES = ("system", "developer", "user", "assistant", "tool")

TOOL_CHOICES = ("none", "auto", "required")

#: Fields a response message carries, which a client may send back with it: they pass empty.
_RESPONSE_ONLY = ("refusal", "annotations", "audio", "function_call")


@dataclass(frozen=True)
class EmbedsPart:
    """An ``image_embeds`` part's value, unread (base64 text, or an object of base64 texts)."""

    value: str | dict[str, str]


MediaSource = str | EmbedsPart
"""Where an image part's image comes from: a URL, or its feature rows."""


def template_messages(
    messages: Sequence[ChatMessage],
    template: str | None = None,
    image_token: str | None = None,
    images: list[tuple[MediaSource, str]] | None = None,
) -> list[dict[str, Any]]:
    """The messages as the chat template expects them; `template` is the template's source (to
    see whether it knows the developer role). With `image_token` (a model that takes images),
    each image part's ``(source, where)`` is appended to `images`, in order."""
    if not messages:
        raise RequestError("messages must not be empty", "messages")
    developer = template is not None and "developer" in template
    media = _Images(image_token, images if images is not None else [])
    return [_message(m, f"messages[{i}]", developer, media) for i, m in enumerate(messages)]


class _Images:
    """Where image parts go: the placeholder text, and the list of their URLs."""

    def __init__(self, token: str | None, urls: list[tuple[MediaSource, str]]) -> None:
        self.token = token
        self.urls = urls


def _message(m: ChatMessage, where: str, developer: bool, media: _Images) -> dict[str, Any]:
    if m.role not in ROLES:
        raise RequestError(f"{where}.role must be one of {', '.join(ROLES)}, got {m.role!r}", f"{where}.role")
    for name in _RESPONSE_ONLY:
        if getattr(m, name) not in (None, []):
            raise RequestError(f"{where}.{name} is not supported in a request message", f"{where}.{name}")
    if m.content is None and m.role != "assistant":
        raise RequestError(f"{where}.content must not be null (only an assistant message's may)", f"{where}.content")
    if m.tool_calls is not None and m.role != "assistant":
        raise RequestError(f"{where}.tool_calls: only an assistant message carries tool calls", f"{where}.tool_calls")
    if m.role == "tool" and not m.tool_call_id:
        raise RequestError(f"{where}: a tool message needs the tool_call_id it answers", f"{where}.tool_call_id")
    if m.role != "tool" and m.tool_call_id is not None:
        raise RequestError(f"{where}.tool_call_id: only a tool message answers a call", f"{where}.tool_call_id")
    role = "system" if m.role == "developer" and not developer else m.role
    out: dict[str, Any] = {"role": role, "content": _text(m.content, f"{where}.content", media)}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls is not None:
        out["tool_calls"] = [_tool_call(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(m.tool_calls)]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
    if reasoning is not None:
        out["reasoning_content"] = reasoning
    return out


def _text(content: str | list[TextPart] | None, where: str, media: _Images) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type in ("image_url", "image_embeds"):
            texts.append(_image(part, f"{where}[{j}]", where, media))
            continue
        if part.type != "text":
            raise RequestError(f"content part type {part.type!r} is not supported (only 'text')", where)
        if part.text is None:
            raise RequestError("a 'text' content part needs its `text`", where)
        texts.append(part.text)
    return "\n".join(texts)


def _image(part: TextPart, where: str, content: str, media: _Images) -> str:
    if media.token is None:
        raise RequestError(
            f"content part type {part.type!r} is not supported: this model does not accept images", content
        )
    if part.type == "image_embeds":
        if part.image_embeds is None:
            raise RequestError("an 'image_embeds' content part needs its `image_embeds`", where)
        media.urls.append((EmbedsPart(part.image_embeds), f"{where}.image_embeds"))
        return media.token
    if part.image_url is None:
        raise RequestError("an 'image_url' content part needs its `image_url`", where)
    if part.image_url.detail not in (None, "auto"):
        raise RequestError(
            f"image_url.detail {part.image_url.detail!r} is not supported (only 'auto': the model takes one fixed size)",
            f"{where}.image_url.detail",
        )
    media.urls.append((part.image_url.url, f"{where}.image_url.url"))
    return media.token


def _tool_call(call: ToolCall, where: str) -> dict[str, Any]:
    if call.type != "function":
        raise RequestError(f"{where}.type must be 'function', got {call.type!r}", f"{where}.type")
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError as exc:
        raise RequestError(
            f"{where}.function.arguments is not valid JSON: {exc}", f"{where}.function.arguments"
        ) from None
    if not isinstance(arguments, dict):
        raise RequestError(f"{where}.function.arguments must be a JSON object", f"{where}.function.arguments")
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


def template_tools(tools: Sequence[ChatTool] | None) -> list[dict[str, Any]] | None:
    """`tools` as the template expects them (None: the request has none)."""
    if tools is None:
        return None
    names: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise RequestError(f"tools[{i}].type must be 'function', got {tool.type!r}", f"tools[{i}].type")
        if tool.function.name in names:
            raise RequestError(f"two tools are named {tool.function.name!r}", f"tools[{i}].function.name")
        names.add(tool.function.name)
    return [
        {"type": "function", "function": {k: v for k, v in msgspec.to_builtins(t.function).items() if v is not None}}
        for t in tools
    ]


def tool_choice_of(
    tool_choice: str | NamedToolChoice | None, tools: Sequence[ChatTool] | None
) -> str | NamedToolChoice:
    """The request's tool choice checked against its tools: "none", "auto", "required", or the
    named function to call. Absent: "auto" with tools, else "none" (as OpenAI); "auto" without
    tools leaves nothing to call, so it is "none"."""
    names = [t.function.name for t in tools or ()]
    if tool_choice is None:
        return "auto" if tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise RequestError(
                f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a named function, got {tool_choice!r}",
                "tool_choice",
            )
        if tool_choice == "required" and not tools:
            raise RequestError("tool_choice 'required' needs tools", "tool_choice")
        return "none" if tool_choice == "auto" and not tools else tool_choice
    if tool_choice.type != "function":
        raise RequestError(f"tool_choice.type must be 'function', got {tool_choice.type!r}", "tool_choice.type")
    name = tool_choice.function.name
    if not tools:
        raise RequestError(f"tool_choice names the function {name!r} but the request has no tools", "tool_choice")
    if name not in names:
        raise RequestError(
            f"tool_choice names the function {name!r}, which is not in tools ({', '.join(names)})",
            "tool_choice.function.name",
        )
    return tool_choice
