"""Structured outputs through the engine (`sonar.open`) on the real embedded model (SmolLM2-135M).

One engine with async scheduling on serves the module (the bitmask of a step then follows it in
a `StepBitmask` once the previous step's tokens are fed); a second one, synchronous and with a
worker crash injected, checks that a request that loses its worker mid-JSON still ends valid.
Every JSON output is parsed and validated with `jsonschema` unless `max_tokens` cut it.
"""

from __future__ import annotations

import json
import re
from typing import Any

import anyio
import jsonschema
import pytest

import sonar
from sonar import InvalidRequestError, SamplingParams
from sonar.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.anyio

ENGINE = dict(dtype="float32", max_model_len=512, num_gpu_blocks_override=160, seed=0)

NAME = {"type": "string", "minLength": 1, "maxLength": 12}

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
    },
    "nested_address": {
        "type": "object",
        "properties": {
            "city": NAME,
            "address": {
                "type": "object",
                "properties": {"street": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "zip"],
            },
        },
        "required": ["city", "address"],
    },
    "tags_array": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
    },
    "color_enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
    },
    "any_of": {
        "type": "object",
        "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 999}, NAME]}},
        "required": ["id"],
    },
    "pattern_code": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["code"],
    },
    "number_bounds": {
        "type": "object",
        "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["score"],
    },
    "integer_bounds": {
        "type": "object",
        "properties": {"year": {"type": "integer", "minimum": 1900, "maximum": 2100}},
        "required": ["year"],
    },
    "boolean_flag": {
        "type": "object",
        "properties": {"done": {"type": "boolean"}, "title": NAME},
        "required": ["done", "title"],
    },
    "array_of_objects": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
                    "required": ["id", "ok"],
                },
                "minItems": 1,
                "maxItems": 2,
            }
        },
        "required": ["items"],
    },
    "top_level_array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4},
    "const_version": {
        "type": "object",
        "properties": {"version": {"const": "v1"}, "name": NAME},
        "required": ["version", "name"],
    },
    "nullable": {
        "type": "object",
        "properties": {"nickname": {"type": ["string", "null"], "maxLength": 8}},
        "required": ["nickname"],
    },
    "one_of": {
        "type": "object",
        "properties": {
            "shape": {
                "oneOf": [
                    {
                        "type": "object",
                        "properties": {
                            "kind": {"const": "circle"},
                            "r": {"type": "integer", "minimum": 1, "maximum": 9},
                        },
                        "required": ["kind", "r"],
                    },
                    {
                        "type": "object",
                        "properties": {
                            "kind": {"const": "square"},
                            "a": {"type": "integer", "minimum": 1, "maximum": 9},
                        },
                        "required": ["kind", "a"],
                    },
                ]
            }
        },
        "required": ["shape"],
    },
    "refs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
    },
    "string_lengths": {
        "type": "object",
        "properties": {"word": {"type": "string", "minLength": 3, "maxLength": 5, "pattern": "^[a-z]+$"}},
        "required": ["word"],
    },
    "closed_object": {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a"],
        "additionalProperties": False,
    },
    "deep_nesting": {
        "type": "object",
        "properties": {
            "l1": {
                "type": "object",
                "properties": {
                    "l2": {
                        "type": "object",
                        "properties": {"l3": {"type": "integer", "maximum": 5}},
                        "required": ["l3"],
                    }
                },
                "required": ["l2"],
            }
        },
        "required": ["l1"],
    },
    "integer_enum": {
        "type": "object",
        "properties": {"level": {"type": "integer", "enum": [1, 2, 3]}},
        "required": ["level"],
    },
    "matrix": {
        "type": "object",
        "properties": {
            "rows": {
                "type": "array",
                "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 2},
                "minItems": 1,
                "maxItems": 2,
            }
        },
        "required": ["rows"],
    },
    "optional_fields": {
        "type": "object",
        "properties": {"name": NAME, "email": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name"],
    },
    "exclusive_bounds": {
        "type": "object",
        "properties": {"temp": {"type": "integer", "exclusiveMinimum": -10, "exclusiveMaximum": 40}},
        "required": ["temp"],
    },
}


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
async def llm(one_thread):
    async with sonar.open(**ENGINE, async_scheduling=True) as engine:
        yield engine


def constrained(max_tokens: int = 96, temperature: float = 0.0, seed: int | None = None, **spec: Any) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        structured_outputs=StructuredOutputsParams(**spec),
    )


def ask(schema: dict[str, Any]) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Reply with one JSON value for this schema: {json.dumps(schema)}"}]


def check_json(text: str, finish_reason: str | None, schema: dict[str, Any]) -> bool:
    """Valid against the schema, or cut by max_tokens; True when it finished on its own."""
    if finish_reason == "length":
        return False
    assert finish_reason == "stop", (finish_reason, text)
    jsonschema.validate(json.loads(text), schema)
    return True


async def test_json_schemas_yield_valid_json_greedy_and_sampled(llm) -> None:
    """Every schema twice: greedy, and at temperature 1 with a seed; compact JSON for half. The
    44 prompts are prefilled in chunks beside other requests' decodes."""
    results: dict[tuple[str, bool], Any] = {}

    async def one(name: str, schema: dict[str, Any], sampled: bool) -> None:
        params = constrained(
            temperature=1.0 if sampled else 0.0,
            seed=7 if sampled else None,
            json=schema,
            disable_any_whitespace=sampled,
        )
        results[name, sampled] = await llm.chat(ask(schema), params)

    async with anyio.create_task_group() as tg:
        for name, schema in SCHEMAS.items():
            for sampled in (False, True):
                tg.start_soon(one, name, schema, sampled)
    finished = 0
    for (name, sampled), out in results.items():
        finished += check_json(out.text, out.finish_reason, SCHEMAS[name])
        if sampled and out.finish_reason == "stop":
            assert "\n" not in out.text and "  " not in out.text, (name, out.text)  # disable_any_whitespace
    assert finished >= len(results) - 2, f"only {finished} of {len(results)} outputs ended before max_tokens"


async def test_regex_choice_grammar_and_json_object(llm) -> None:
    regex = r"[A-Z][a-z]{2,8} [0-9]{3}-[0-9]{4}"
    out = await llm.generate("Name and phone number:", constrained(regex=regex, max_tokens=32))
    assert out.finish_reason == "stop" and re.fullmatch(regex, out.text), out.text

    choices = ["positive", "negative", "neutral"]
    out = await llm.chat(
        [{"role": "user", "content": "Sentiment of 'I love it'?"}],
        constrained(choice=choices, temperature=1.0, seed=3),
    )
    assert out.text in choices and out.finish_reason == "stop"

    ebnf = 'root ::= "SELECT " column " FROM " table ";"\ncolumn ::= "id" | "name" | "*"\ntable ::= [a-z]+'
    out = await llm.generate("A SQL query:", constrained(grammar=ebnf, max_tokens=24))
    assert out.finish_reason == "stop" and re.fullmatch(r"SELECT (id|name|\*) FROM [a-z]+;", out.text), out.text

    out = await llm.chat(
        ask({"type": "object"}), constrained(json_object=True, max_tokens=64, disable_any_whitespace=True)
    )
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict), out.text


async def test_the_guidance_backend_and_the_auto_fallback(llm) -> None:
    for name in ("person", "nested_address", "color_enum"):
        schema = SCHEMAS[name]
        out = await llm.chat(ask(schema), constrained(json=schema, backend="guidance"))
        assert check_json(out.text, out.finish_reason, schema), out.text
    lark = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'
    out = await llm.generate("Question: is water wet?", constrained(grammar=lark, backend="guidance", max_tokens=16))
    assert out.text in ("The answer is yes.", "The answer is no."), out.text
    # xgrammar reads EBNF, not Lark, and takes no whitespace_pattern: auto falls back to guidance
    out = await llm.generate("Question: is fire cold?", constrained(grammar=lark, max_tokens=16))
    assert out.text in ("The answer is yes.", "The answer is no."), out.text
    schema = SCHEMAS["person"]
    out = await llm.chat(ask(schema), constrained(json=schema, whitespace_pattern=r"[ ]?"))
    assert check_json(out.text, out.finish_reason, schema) and "\n" not in out.text, out.text
    with pytest.raises(InvalidRequestError, match="whitespace_pattern") as caught:
        await llm.generate("x", constrained(json=schema, whitespace_pattern=" ", backend="xgrammar"))
    assert caught.value.param == "structured_outputs"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (dict(json={"type": "object", "properties": {"a": {"type": 5}}}), "xgrammar"),
        (dict(json="{not json"), "not valid JSON"),
        (dict(regex="(ab"), "parenthes"),
        (dict(grammar="root ::= "), "guidance"),
        (dict(grammar='root ::= "a"', backend="guidance"), "Expected token"),
        (dict(regex="a", backend="outlines"), "outlines"),
        (dict(structural_tag='{"type": "structural_tag"}', backend="guidance"), "structural_tag"),
        (dict(regex="a" * 70_000), "max-structured-output-chars"),
    ],
)
async def test_a_spec_that_does_not_compile_is_an_invalid_request(llm, spec, message) -> None:
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as caught:
        await llm.generate("x", constrained(**spec))
    assert caught.value.param == "structured_outputs"


async def test_combinations_that_cannot_work_are_refused_naming_both(llm) -> None:
    for name, value in (("ignore_eos", True), ("min_tokens", 2)):
        params = SamplingParams(
            max_tokens=8, **{name: value}, structured_outputs=StructuredOutputsParams(regex="[a-z]+")
        )
        with pytest.raises(InvalidRequestError, match=f"{name} cannot be combined with structured_outputs") as caught:
            await llm.generate("x", params)
        assert caught.value.param == name


async def test_n_logprobs_stop_strings_and_the_prefix_cache(llm) -> None:
    schema = SCHEMAS["person"]
    params = SamplingParams(
        n=2,
        max_tokens=96,
        temperature=1.0,
        seed=11,
        logprobs=2,
        structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True),
    )
    out = await llm.chat(ask(schema), params)
    for completion in out.outputs:
        check_json(completion.text, completion.finish_reason, schema)
        assert len(completion.logprobs) == len(completion.token_ids)
        # the grammar's mask is applied before the logprobs: the chosen token was allowed
        assert all(p.logprob > float("-inf") for p in completion.logprobs)

    params = SamplingParams(
        max_tokens=24,
        temperature=0.0,
        stop=[";"],
        structured_outputs=StructuredOutputsParams(regex="[a-z]{2,6};[a-z]{2,6}"),
    )
    stopped = await llm.generate("Two words:", params)
    assert stopped.finish_reason == "stop" and stopped.stop_reason == ";" and re.fullmatch("[a-z]{2,6}", stopped.text)

    prompt = ask(SCHEMAS["nested_address"])
    params = constrained(json=SCHEMAS["nested_address"])
    first = await llm.chat(prompt, params)
    second = await llm.chat(prompt, params)
    assert second.num_cached_tokens > 0
    assert second.text == first.text
    check_json(second.text, second.finish_reason, SCHEMAS["nested_address"])


#: What a worker crash interrupts mid-JSON: three requests at once.
CRASHED = ("person", "array_of_objects", "nested_address")


@pytest.fixture(scope="module")
async def preempted(one_thread) -> tuple[list[str], int]:
    """The JSON of the three CRASHED requests in a KV cache too small for them at once (some are
    preempted and recomputed), and the engine's preemption count: the reference that both
    worker-crash runs must match."""
    tight = dict(ENGINE, max_model_len=256, num_gpu_blocks_override=16, enable_prefix_caching=False)
    chunked = dict(long_prefill_token_threshold=32, scheduler_reserve_full_isl=False)  # all three admitted
    async with sonar.open(**tight, **chunked, async_scheduling=False) as llm:
        texts = []

        async def one(schema: dict[str, Any]) -> None:
            texts.append((await llm.chat(ask(schema), constrained(json=schema))).text)

        async with anyio.create_task_group() as tg:
            for name in CRASHED:
                tg.start_soon(one, SCHEMAS[name])
        return texts, (await llm.stats()).num_preemptions


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
async def test_a_worker_crash_mid_json_still_ends_in_valid_json(preempted, async_scheduling: bool) -> None:
    """First in a KV cache too small for the three requests at once (some are preempted), then
    with the worker raising in step 12 (the JSON half written; with async scheduling the step sent
    behind it, waiting for its bitmask, goes down with it): each time a request is recomputed
    from the tokens it keeps, and its matcher, which holds exactly those tokens, goes on from
    there; both runs give the same valid JSON."""
    reference, preemptions = preempted
    assert preemptions > 0
    async with sonar.open(**ENGINE, async_scheduling=async_scheduling, fault_injection="raise@step=12") as llm:
        outs = []

        async def one(schema: dict[str, Any]) -> None:
            outs.append((schema, await llm.chat(ask(schema), constrained(json=schema))))

        async with anyio.create_task_group() as tg:
            for name in CRASHED:
                tg.start_soon(one, SCHEMAS[name])
        worker = next(c for c in llm.tree().children if c.name == "worker")
        assert worker.restarts == 1
        for schema, out in outs:
            assert check_json(out.text, out.finish_reason, schema), out.text
        assert sorted(out.text for _, out in outs) == sorted(reference)
