"""Reasoning formats on canned outputs of DeepSeek-R1, Qwen3 and Granite 3.x; streams add up to the whole."""

from __future__ import annotations

import pytest

from sonar.parsers.reasoning import ReasoningStream, reasoning_format, split_reasoning
from tests.parsers.streaming import random_pieces

R1 = "Okay, the user asks for 2 + 2. That is 4.\n</think>\n\nThe answer is **4**."
QWEN3 = "<think>\nThe user greets me. I should greet back.\n</think>\n\nHello! How can I help you today?"
QWEN3_NO_THINKING = "Hello! How can I help you today?"
GRANITE = (
    "Here is my thought process:\nThe user wants a haiku about rain. Five, seven, five.\n"
    "Here is my response:\nSoft rain on the roof\nwhispers to the sleeping town\npuddles hold the sky"
)


def both_ways(name: str, text: str, opened: bool = False) -> tuple[str | None, str | None]:
    fmt = reasoning_format(name)
    whole = split_reasoning(fmt, text, opened)
    for pieces in [list(text), [text], *(random_pieces(text, seed) for seed in range(8))]:
        s = ReasoningStream(fmt, opened)
        reasoning = content = ""
        for r, c in [*(s.feed(p) for p in pieces), s.finish()]:
            reasoning, content = reasoning + r, content + c
        assert (reasoning or None, content or None) == (whole.reasoning, whole.content), pieces
    return whole.reasoning, whole.content


def test_deepseek_r1_opening_tag_in_the_prompt() -> None:
    assert both_ways("deepseek_r1", R1) == (
        "Okay, the user asks for 2 + 2. That is 4.\n",
        "The answer is **4**.",
    )


def test_deepseek_r1_opening_tag_in_the_output() -> None:
    reasoning, content = both_ways("deepseek_r1", "<think>\n" + R1)
    assert reasoning == "\nOkay, the user asks for 2 + 2. That is 4.\n" and content == "The answer is **4**."


def test_deepseek_r1_cut_while_thinking_is_all_thinking() -> None:
    assert both_ways("deepseek_r1", "<think>Let me think about th") == ("Let me think about th", None)


def test_qwen3_thinking() -> None:
    assert both_ways("qwen3", QWEN3) == (
        "\nThe user greets me. I should greet back.\n",
        "Hello! How can I help you today?",
    )


def test_qwen3_without_thinking_is_all_content() -> None:
    assert both_ways("qwen3", QWEN3_NO_THINKING) == (None, QWEN3_NO_THINKING)
    # A stray closing tag in an answer that never opened thinking is just text.
    assert both_ways("qwen3", "Use </think> to close.") == (None, "Use </think> to close.")


def test_qwen3_thinking_opened_by_the_prompt() -> None:
    fmt = reasoning_format("qwen3")
    assert fmt.opened_by("<|im_start|>assistant\n<think>\n")
    assert not fmt.opened_by("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert both_ways("qwen3", "Greet back.\n</think>\n\nHi!", opened=True) == ("Greet back.\n", "Hi!")


def test_a_prompt_that_closed_the_thinking() -> None:
    # Qwen3's template with enable_thinking=false; deepseek_r1 would otherwise read the answer as thinking
    for name in ("qwen3", "deepseek_r1"):
        fmt = reasoning_format(name)
        assert fmt.closed_by("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert not fmt.closed_by("<|im_start|>assistant\n<think>\n")
    assert reasoning_format("granite").closed_by("Here is my thought process: rain. Here is my response:")


def test_granite() -> None:
    reasoning, content = both_ways("granite", GRANITE)
    assert reasoning == "\nThe user wants a haiku about rain. Five, seven, five.\n"
    assert content is not None and content.startswith("Soft rain on the roof")
    assert both_ways("granite", "Here is the haiku: rain.") == (None, "Here is the haiku: rain.")


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3", "granite"])
def test_empty_output(name: str) -> None:
    assert both_ways(name, "") == (None, None)
