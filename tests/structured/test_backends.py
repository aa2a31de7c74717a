"""xgrammar and llguidance over the embedded model's tokenizer: what each compiles, ``auto``'s
choice, and the matchers the scheduler core drives."""

from __future__ import annotations

import json

import pytest
import torch

from sonar.core import BlockManager, Request, Scheduler, SchedulerConfig
from sonar.errors import InvalidRequestError
from sonar.structured import StructuredOutputsConfig, allocate_bitmask, fill_bitmasks, unpack_allowed
from tests.structured.conftest import EOS, VOCAB, compile_, run


def test_both_backends_match_what_they_compiled(compiler, tokenizer) -> None:
    for backend in ("xgrammar", "guidance"):
        matcher = compile_(compiler, regex="[0-9]{3}", backend=backend).matcher()
        assert run(matcher, tokenizer, "12") and not matcher.is_terminated()
        bitmask = allocate_bitmask(2, VOCAB)
        matcher.fill_bitmask(bitmask, 1)
        allowed = unpack_allowed(bitmask, VOCAB)
        assert allowed[0].all()  # row 0 untouched
        digits = {tokenizer.decode([t]) for t in allowed[1].nonzero().flatten().tolist()}
        assert "7" in digits and all(d.isdigit() for d in digits), sorted(digits)[:10]
        assert run(matcher, tokenizer, "3")
        assert matcher.is_terminated() or matcher.accept_token(EOS) and matcher.is_terminated()
        refused = compile_(compiler, regex="[0-9]{3}", backend=backend).matcher()
        assert not refused.accept_token(tokenizer("x", add_special_tokens=False).input_ids[0])


def test_auto_and_the_server_config(compiler, tokenizer) -> None:
    lark = 'start: "a" "b"+'
    assert compile_(compiler, grammar=lark).backend == "guidance"  # not EBNF: xgrammar fails
    assert compile_(compiler, grammar='root ::= "a" "b"+').backend == "xgrammar"
    both = {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}
    assert compile_(compiler, json=both).backend == "guidance"  # xgrammar would drop maxLength
    with pytest.raises(InvalidRequestError, match="maxLength"):
        compile_(compiler, json=both, backend="xgrammar")
    loose = {"type": "object", "properties": {"a": {"type": "integer"}}}
    config = StructuredOutputsConfig(backend="guidance", disable_additional_properties=True)
    matcher = compile_(compiler, config, json=loose).matcher()
    assert run(matcher, tokenizer, '{"a": 1')
    assert not run(matcher, tokenizer, ', "b')
    matcher = compile_(compiler, StructuredOutputsConfig(backend="guidance"), json=loose).matcher()
    assert run(matcher, tokenizer, '{"a": 1, "b')


def test_the_core_advances_a_matcher_with_the_tokens_a_request_keeps(compiler, tokenizer) -> None:
    """Accepted tokens advance it; the grammar's end finishes the request with "stop"; a token it
    refuses fails the request alone."""
    scheduler = Scheduler(SchedulerConfig(max_model_len=64), BlockManager(16, 16))
    grammar = compile_(compiler, choice=["yes", "no"])
    ok = Request("ok", [1, 2, 3], max_tokens=10, stop_token_ids=[EOS], grammar=grammar.matcher())
    bad = Request("bad", [1, 2, 3], max_tokens=10, stop_token_ids=[EOS], grammar=grammar.matcher())
    for request in (ok, bad):
        scheduler.add_request(request)
    scheduler.schedule()
    yes = tokenizer("yes", add_special_tokens=False).input_ids
    assert len(yes) == 1  # one step's token
    updates = {u.req_id: u for u in scheduler.update_from_output({"ok": yes, "bad": [EOS]})}
    assert updates["ok"].finish_reason is None and updates["ok"].new_token_ids == yes
    assert updates["bad"].finish_reason == "error" and updates["bad"].error.type == "grammar"
    scheduler.schedule()
    (update,) = scheduler.update_from_output({"ok": [EOS]})
    assert update.finish_reason == "stop" and update.stop_reason == EOS
    assert not scheduler.requests
    scheduler.check_invariants()


def test_fill_bitmasks_fills_each_row_from_its_matcher(compiler, tokenizer) -> None:
    """xgrammar's rows batched, llguidance's one by one, None rows allow everything: the same
    rows as filling each matcher alone."""
    specs = [("xgrammar", "[0-9]+"), ("guidance", "[a-c]+"), ("xgrammar", "x|y"), (None, None), ("xgrammar", "q")]
    matchers = [None if b is None else compile_(compiler, regex=r, backend=b).matcher() for b, r in specs]
    together = allocate_bitmask(6, VOCAB)
    together[5] = 7  # past the rows: untouched
    fill_bitmasks(matchers, together)
    for i, matcher in enumerate(matchers):
        alone = allocate_bitmask(1, VOCAB)
        if matcher is not None:
            matcher.fill_bitmask(alone, 0)
        assert torch.equal(together[i], alone[0]), i
    assert (together[5] == 7).all()
    assert not unpack_allowed(together[:1], VOCAB).all()


def test_structural_tags_in_both_forms_compile_with_xgrammar(compiler, tokenizer) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    current = {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": "<call>",
            "content": {"type": "json_schema", "json_schema": schema},
            "end": "</call>",
        },
    }
    legacy = {"structures": [{"begin": "<call>", "schema": schema, "end": "</call>"}], "triggers": ["<call>"]}
    for tag in (current, legacy):
        compiled = compile_(compiler, structural_tag=json.dumps(tag))
        assert compiled.backend == "xgrammar"
        matcher = compiled.matcher()
        assert run(matcher, tokenizer, '<call>{"city": "Paris"}</call>')
    with pytest.raises(InvalidRequestError, match="structural_tag"):
        compile_(compiler, structural_tag='{"structures": [{"begin": "<a>"}], "triggers": []}')
