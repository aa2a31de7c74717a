"""`ThinkingGate`: a grammar that waits for the end of the thinking, on the real SmolLM2 tokenizer
and a real xgrammar matcher (a regex of three digits)."""

from __future__ import annotations

import pytest
import torch

from sonar.core.thinking import ThinkingGate
from sonar.models.embedded import load_tokenizer
from sonar.sampling_params import StructuredOutputsParams
from sonar.structured import StructuredOutputsConfig, allocate_bitmask, compiler_for, fill_bitmasks
from sonar.structured.bitmask import unpack_allowed


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return compiler_for("smollm2-test-thinking", len(tokenizer), [tokenizer.eos_token_id], tokenizer)


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def gate(compiler, ends=("</think>",), prompt=(), starts=()) -> ThinkingGate:
    compiled = compiler.compile_sync(
        StructuredOutputsParams(regex="[0-9]{3}"), StructuredOutputsConfig(), max_chars=1000, timeout=30
    )
    opening_ids, opening_row = compiler.opening_tokens(tuple(starts))
    return ThinkingGate(
        compiled.matcher(),
        ends,
        compiler.token_bytes(),
        prompt,
        starts=starts,
        opening_ids=opening_ids,
        opening_row=opening_row,
    )


def allowed(g: ThinkingGate, vocab: int) -> torch.Tensor:
    bitmask = allocate_bitmask(1, vocab)
    bitmask.zero_()
    fill_bitmasks([g], bitmask)
    return unpack_allowed(bitmask, vocab)[0]


def test_the_thinking_is_free_and_the_grammar_starts_after_its_marker(tokenizer, compiler) -> None:
    vocab = len(tokenizer)
    g = gate(compiler)
    assert g.thinking and allowed(g, vocab).all()  # every token while thinking, one fill of the row
    for token in ids(tokenizer, "Three digits, then. I am done</"):
        assert g.accept_token(token) and g.thinking and not g.is_terminated()
    assert g.accept_token(ids(tokenizer, "think")[0]) and g.thinking
    assert g.accept_token(ids(tokenizer, ">")[0]) and not g.thinking  # the marker, in three pieces
    digits = allowed(g, vocab)
    assert digits[ids(tokenizer, "4")[0]] and not digits[ids(tokenizer, "a")[0]]
    assert not g.accept_token(ids(tokenizer, "x")[0])  # the grammar decides now
    g = gate(compiler)
    for token in ids(tokenizer, "ok</think>123"):
        assert g.accept_token(token)
    assert g.is_terminated() or allowed(g, vocab)[tokenizer.eos_token_id]


def test_a_marker_found_inside_a_token_and_a_special_token_marker(tokenizer, compiler) -> None:
    g = gate(compiler, ends=("Here is my response:",))
    for token in ids(tokenizer, "I think. Here is my response:"):
        g.accept_token(token)
    assert not g.thinking
    # a marker that is one special token of the vocabulary (as Qwen3's </think> is)
    g = gate(compiler, ends=("<|im_end|>",))
    assert g.accept_token(ids(tokenizer, "hm")[0]) and g.thinking
    assert g.accept_token(tokenizer.convert_tokens_to_ids("<|im_end|>")) and not g.thinking


def test_a_prompt_that_ended_the_thinking_is_constrained_from_the_first_token(tokenizer, compiler) -> None:
    vocab = len(tokenizer)
    closed = gate(compiler, prompt=ids(tokenizer, "<|im_start|>assistant\n<think>\n\n</think>\n\n"))
    assert not closed.thinking and not allowed(closed, vocab)[ids(tokenizer, "a")[0]]
    for prompt in ("<|im_start|>assistant\n<think>\n", "</think> earlier turn <think>\nstill", ""):
        assert gate(compiler, prompt=ids(tokenizer, prompt)).thinking, prompt


# SmolLM2 has no <think> token: its chat markers stand in for a format whose start marker is one
# special token (Qwen3's <think>), so that the model may or may not think
START, END = "<|im_start|>", "<|im_end|>"


def test_a_model_that_may_think_decides_at_its_first_token(tokenizer, compiler) -> None:
    vocab = len(tokenizer)
    start = tokenizer.convert_tokens_to_ids(START)
    assert compiler.opening_tokens((START,))[0] == {start}
    first = allowed(gate(compiler, ends=(END,), starts=(START,)), vocab)
    assert first[start] and first[ids(tokenizer, "4")[0]] and not first[ids(tokenizer, "a")[0]]
    answers = gate(compiler, ends=(END,), starts=(START,))
    assert answers.accept_token(ids(tokenizer, "4")[0]) and not answers.thinking and not answers.undecided
    assert not allowed(answers, vocab)[start]  # the grammar alone from then on
    thinks = gate(compiler, ends=(END,), starts=(START,))
    assert thinks.accept_token(start) and thinks.thinking and allowed(thinks, vocab).all()
    for token in ids(tokenizer, "free text" + END):
        assert thinks.accept_token(token)
    assert not thinks.thinking and not allowed(thinks, vocab)[start]
    # a prompt that opened the thinking, or ended it, decides instead
    assert gate(compiler, ends=(END,), starts=(START,), prompt=ids(tokenizer, "x" + START + "\n")).thinking
    ended = gate(compiler, ends=(END,), starts=(START,), prompt=ids(tokenizer, START + "x" + END + "\n"))
    assert not ended.thinking and not ended.undecided
    # a start marker spelled in several tokens cannot open it: the model answers, constrained
    assert compiler.opening_tokens(("<think>",))[0] == frozenset()


def test_a_gate_needs_a_marker(compiler) -> None:
    with pytest.raises(ValueError, match="end marker"):
        gate(compiler, ends=())


def test_gates_in_one_batch_fill_as_they_would_alone(tokenizer, compiler) -> None:
    vocab = len(tokenizer)
    thinking = gate(compiler)
    answering = gate(compiler, prompt=ids(tokenizer, "</think>"))
    undecided = gate(compiler, ends=(END,), starts=(START,))
    plain = answering.matcher
    rows = [thinking, plain, answering, undecided, None]
    bitmask = allocate_bitmask(len(rows), vocab)
    bitmask.zero_()
    fill_bitmasks(rows, bitmask)
    together = unpack_allowed(bitmask, vocab)
    assert together[0].all() and together[4].all()
    assert torch.equal(together[1], together[2]) and not together[2].all()
    assert torch.equal(together[3], allowed(undecided, vocab))
    assert torch.equal(together[3] & ~together[2], unpack_allowed(compiler.opening_tokens((START,))[1][None], vocab)[0])
