"""Structured outputs after the thinking, through the engine (`sonar.open`) on the real SmolLM2.

SmolLM2 does not think by itself, so the prompt puts it mid-thought (an assistant message
"<think>\\nI will answer" continued), and a reasoning parser registered by a plugin file (as
--reasoning-parser-plugin loads one) ends the thinking at ".", which the model writes on its own:
greedy, it goes on " your question." and then would write a Markdown block. The grammar must let
the thinking through as the model wrote it and constrain only what follows the ".".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

import sonar
from sonar import SamplingParams
from sonar.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.anyio

PLUGIN = """
from sonar.parsers.reasoning import ReasoningFormat, register_reasoning_parser


@register_reasoning_parser("dot_thinking")
class DotThinking(ReasoningFormat):
    starts = ("<think>",)
    ends = (".",)
    thinks_first = True
"""

ENGINE = dict(dtype="float32", max_model_len=512, num_gpu_blocks_override=160, seed=0)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}
QUESTION = {"role": "user", "content": "Give me a person (name and age) as JSON."}
THINKING = [QUESTION, {"role": "assistant", "content": "<think>\nI will answer"}]
THOUGHT = [QUESTION, {"role": "assistant", "content": "<think>\nI will answer your question."}]


def write_plugin(folder: Path) -> str:
    path = folder / "dot_thinking.py"
    path.write_text(PLUGIN)
    return str(path)


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def plugin(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_plugin(tmp_path_factory.mktemp("reasoning"))


@pytest.fixture(scope="module")
async def llm(one_thread: Any, plugin: str) -> Any:
    config = {"reasoning_parser": "dot_thinking", "reasoning_parser_plugin": plugin}
    async with sonar.open(**ENGINE, async_scheduling=True, structured_outputs_config=config) as engine:
        yield engine


def params(max_tokens: int = 40, **kw: Any) -> SamplingParams:
    return SamplingParams(
        **{"max_tokens": max_tokens, "temperature": 0.0, **kw}, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )


async def chat(llm: Any, messages: list[dict[str, str]], p: SamplingParams) -> Any:
    return await llm.chat(messages, p, add_generation_prompt=False, continue_final_message=True)


def answer(text: str) -> Any:
    thought, rest = text.split(".", 1)
    with pytest.raises(ValueError):
        json.loads(thought)
    value = json.loads(rest)
    jsonschema.validate(value, SCHEMA)
    return thought, value


async def test_the_thinking_is_free_and_the_answer_follows_the_schema(llm: Any) -> None:
    free = await chat(llm, THINKING, SamplingParams(max_tokens=40, temperature=0))
    assert free.text.startswith(" your question.\n\n```json")  # what the model does unconstrained
    out = await chat(llm, THINKING, params())
    thought, value = answer(out.text)
    assert thought == " your question" and out.finish_reason == "stop"
    assert set(value) == {"name", "age"}


async def test_a_prompt_that_ended_the_thinking_is_constrained_from_the_first_token(llm: Any) -> None:
    out = await chat(llm, THOUGHT, params())
    jsonschema.validate(json.loads(out.text), SCHEMA)
    assert out.text.startswith("{") and out.finish_reason == "stop"


async def test_the_stream_reassembles_to_the_whole_output(llm: Any) -> None:
    whole = await chat(llm, THINKING, params(n=2, seed=3, temperature=0.8))
    prompt = await llm.apply_chat_template(THINKING, add_generation_prompt=False, continue_final_message=True)
    texts = {0: "", 1: ""}
    async for delta in llm.stream(prompt, params(n=2, seed=3, temperature=0.8)):
        texts[delta.index] += delta.text
    assert [texts[0], texts[1]] == [o.text for o in whole.outputs]
    for text in texts.values():
        answer(text)


async def test_thinking_cut_by_max_tokens_is_length_and_no_json(llm: Any) -> None:
    out = await chat(llm, THINKING, params(max_tokens=2))
    assert out.text == " your question" and out.finish_reason == "length"


async def test_enable_in_reasoning_constrains_the_thinking_too(one_thread: Any, plugin: str) -> None:
    config = {"reasoning_parser": "dot_thinking", "reasoning_parser_plugin": plugin, "enable_in_reasoning": True}
    async with sonar.open(**ENGINE, async_scheduling=False, structured_outputs_config=config) as llm:
        out = await chat(llm, THINKING, params())
    jsonschema.validate(json.loads(out.text), SCHEMA)
    assert out.text.startswith("{")


@pytest.mark.parametrize("step", [3, 5])
async def test_a_worker_crash_around_the_marker_gives_the_same_answer(llm: Any, plugin: str, step: int) -> None:
    # the prefill samples " your", then " question", ".", "{": a crash at step 3 loses the marker's
    # step, at 5 the first steps of the JSON; the gate never runs ahead of the kept tokens
    reference = (await chat(llm, THINKING, params())).text
    config = {"reasoning_parser": "dot_thinking", "reasoning_parser_plugin": plugin}
    crash = f"raise@step={step}"
    async with sonar.open(**ENGINE, structured_outputs_config=config, fault_injection=crash) as crashed:
        out = await chat(crashed, THINKING, params())
        assert next(c for c in crashed.tree().children if c.name == "worker").restarts == 1
    assert out.text == reference
    answer(out.text)
