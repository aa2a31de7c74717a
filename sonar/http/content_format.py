"""--chat-template-content-format: whether a message's content reaches the chat template as one
string or as OpenAI's list of typed parts.

* ``string``: the text parts joined with newlines (`sonar.http.messages`); what most open models'
  templates expect, since they print ``message['content']`` as it is.
* ``openai``: a list of parts, ``[{"type": "text", "text": "..."}]``, for templates that loop over
  the parts (to place images between texts, say). A string content becomes one text part, a null
  one (an assistant's tool calls) no part.
* ``auto``: ``openai`` when the template loops over a message's content (a ``for`` over
  ``m['content']`` or ``m.content``, or over a variable set from it), else ``string``; read from
  the template's syntax tree, as vLLM does, once per template.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import msgspec

from sonar.http.protocol import ChatMessage

FORMATS = ("auto", "openai", "string")


def resolve_content_format(setting: str, template: str | None) -> str:
    """ "string" or "openai": `setting`, with "auto" decided from the template's source."""
    if setting != "auto":
        return setting
    return "openai" if template and loops_over_content(template) else "string"


@functools.lru_cache(maxsize=32)
def loops_over_content(template: str) -> bool:
    """Whether the Jinja template iterates a message's content (see the module docstring)."""
    import jinja2
    from jinja2 import nodes

    try:
        tree = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:  # rendering reports it; a broken template loops over nothing
        return False

    def is_content(node: nodes.Node) -> bool:
        while isinstance(node, nodes.Filter) and node.node is not None:  # m['content'] | list
            node = node.node
        if isinstance(node, nodes.Getitem):
            return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
        return isinstance(node, nodes.Getattr) and node.attr == "content"

    aliases = {
        node.target.name
        for node in tree.find_all(nodes.Assign)
        if isinstance(node.target, nodes.Name) and is_content(node.node)
    }
    for loop in tree.find_all(nodes.For):
        it = loop.iter
        if is_content(it) or (isinstance(it, nodes.Name) and it.name in aliases):
            return True
    return False


def as_parts(messages: list[dict[str, Any]], given: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """`messages` (from `template_messages`, one per `given` message) with each content as the list
    of its parts, the fields a part sets and nothing else."""
    for out, message in zip(messages, given):
        content = message.content
        if content is None:
            out["content"] = []
        elif isinstance(content, str):
            out["content"] = [{"type": "text", "text": content}]
        else:
            out["content"] = [
                {k: v for k, v in msgspec.structs.asdict(part).items() if v is not None} for part in content
            ]
    return messages


def text_as_parts(messages: list[dict[str, Any]], setting: str, template: str | None) -> list[dict[str, Any]]:
    """Messages whose content is text (the Responses API's conversation) in the format `setting`
    resolves to: with "openai", each text becomes one part (an empty one, none)."""
    if resolve_content_format(setting, template) != "openai":
        return messages
    return [{**m, "content": _text_parts(m.get("content"))} for m in messages]


def _text_parts(content: Any) -> Any:
    if not content:
        return []
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def shape_content(
    messages: list[dict[str, Any]], given: Sequence[ChatMessage], setting: str, template: str | None
) -> list[dict[str, Any]]:
    """The template's messages with their content in the format `setting` resolves to."""
    if resolve_content_format(setting, template) == "openai":
        return as_parts(messages, given)
    return messages
