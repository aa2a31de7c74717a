"""--chat-template-content-format: which templates 'auto' reads as looping over content parts (the
embedded model's real template, and templates that loop over parts directly or through a
variable), and what the template then receives, rendered by the real tokenizer."""

from __future__ import annotations

import msgspec
import pytest

from sonar.http.content_format import loops_over_content, resolve_content_format, shape_content, text_as_parts
from sonar.http.messages import template_messages
from sonar.http.protocol import ChatMessage
from sonar.models.embedded import load_tokenizer

#: A template that prints each text part in brackets: it needs the list of parts.
PARTS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% for part in m['content'] %}[{{ part['type'] }}:{{ part['text'] }}]{% endfor %}<|im_end|>\n{% endfor %}"
)
#: The same through a variable, with the string case handled too (as many multimodal templates do).
ALIAS_TEMPLATE = (
    "{% for m in messages %}{% set content = m.content %}"
    "{% if content is string %}{{ content }}{% else %}{% for p in content %}{{ p.text }}{% endfor %}{% endif %}"
    "{% endfor %}"
)


def messages(*raw: dict) -> list[ChatMessage]:
    return [msgspec.convert(m, ChatMessage) for m in raw]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def test_auto_reads_the_embedded_template_as_string(tokenizer) -> None:
    assert not loops_over_content(tokenizer.chat_template)
    assert resolve_content_format("auto", tokenizer.chat_template) == "string"
    assert resolve_content_format("auto", None) == "string"


def test_auto_sees_loops_over_content_parts() -> None:
    assert loops_over_content(PARTS_TEMPLATE)
    assert loops_over_content(ALIAS_TEMPLATE)
    assert resolve_content_format("auto", PARTS_TEMPLATE) == "openai"
    assert not loops_over_content("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert not loops_over_content("{% for m in messages %")  # broken: rendering reports it


def test_explicit_formats_win_over_detection(tokenizer) -> None:
    assert resolve_content_format("string", PARTS_TEMPLATE) == "string"
    assert resolve_content_format("openai", tokenizer.chat_template) == "openai"


def test_openai_format_renders_each_part(tokenizer) -> None:
    given = messages(
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    )  # fmt: skip
    shaped = shape_content(template_messages(given), given, "auto", PARTS_TEMPLATE)
    assert shaped[1]["content"] == [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    assert shaped[0]["content"] == [{"type": "text", "text": "Be brief."}]
    assert shaped[2]["content"] == []
    text = tokenizer.apply_chat_template(shaped[:2], chat_template=PARTS_TEMPLATE, tokenize=False)
    assert text == (
        "<|im_start|>system\n[text:Be brief.]<|im_end|>\n<|im_start|>user\n[text:Hello][text:world]<|im_end|>\n"
    )


def test_string_format_joins_the_parts_for_the_embedded_template(tokenizer) -> None:
    given = messages(
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}
    )
    shaped = shape_content(template_messages(given), given, "auto", tokenizer.chat_template)
    assert shaped[0]["content"] == "Hello\nworld"
    text = tokenizer.apply_chat_template(shaped, tokenize=False)
    assert "<|im_start|>user\nHello\nworld<|im_end|>" in text


def test_text_conversations_become_parts_for_a_parts_template(tokenizer) -> None:
    """The Responses API's conversation (text contents) under the same setting."""
    conversation = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "", "tool_calls": []}]
    assert text_as_parts(conversation, "auto", tokenizer.chat_template) is conversation
    shaped = text_as_parts(conversation, "auto", PARTS_TEMPLATE)
    assert shaped == [
        {"role": "user", "content": [{"type": "text", "text": "Hello"}]},
        {"role": "assistant", "content": [], "tool_calls": []},
    ]
