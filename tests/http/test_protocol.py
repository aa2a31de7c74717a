"""How request bodies become prompts and sampling parameters (the request decoding core)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from sonar.http.protocol import ChatCompletionRequest, CompletionRequest, RequestError, decode_request


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("a", ["a"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2], [[1, 2]]),
        ([[1], [2, 3]], [[1], [2, 3]]),
    ],
)
def test_prompt_shapes(prompt: Any, expected: Any):
    assert CompletionRequest(prompt=prompt).prompts() == expected


@pytest.mark.parametrize("prompt", [[], [1, "a"], [[1], []], [True], [[1.5]]])
def test_bad_prompt_shapes(prompt: Any):
    with pytest.raises(RequestError) as info:
        CompletionRequest(prompt=prompt).prompts()
    assert info.value.param == "prompt"


def test_sampling_fields_map_to_sampling_params():
    req = decode_request(
        b'{"prompt": "x", "logprobs": 2, "echo": true, "stop": "!", "logit_bias": {"5": 1},'
        b' "temperature": null, "top_k": -1, "ignore_eos": true}',
        CompletionRequest,
    )
    p = req.sampling_params()
    assert (p.max_tokens, p.logprobs, p.prompt_logprobs, p.stop, p.logit_bias) == (16, 2, 2, ["!"], {5: 1.0})
    assert (p.temperature, p.top_k, p.ignore_eos) == (1.0, 0, True)
    chat = decode_request(
        b'{"messages": [], "max_tokens": 5, "max_completion_tokens": 7, "logprobs": true, "top_logprobs": 3}',
        ChatCompletionRequest,
    )
    p = chat.sampling_params()
    assert (p.max_tokens, p.logprobs) == (7, 3)
    assert p.structured_outputs is None


@pytest.mark.parametrize(
    "body, kind, param",
    [
        (b'{"prompt": "x", "extra": {"a": 1}}', CompletionRequest, "extra"),
        (b'{"messages": [{"role": "user", "content": "x", "mood": 1}]}', ChatCompletionRequest, "messages[0].mood"),
        (
            b'{"messages": [], "stream_options": {"include_usage": true, "x": 1}}',
            ChatCompletionRequest,
            "stream_options.x",
        ),
        (
            b'{"messages": [], "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema_": {}}}}',
            ChatCompletionRequest,
            "response_format.json_schema.schema_",
        ),
        (b'{"prompt": "x", "structured_outputs": {"regexp": "a"}}', CompletionRequest, "structured_outputs.regexp"),
    ],
)
def test_an_unknown_field_is_refused_by_its_path(body: bytes, kind: type, param: str):
    with pytest.raises(RequestError) as info:
        decode_request(body, kind)
    assert info.value.param == param
    assert str(info.value) == f"unknown field {param!r}: Sonar does not know it (see docs/openai_fields.md)"


def test_a_refused_field_passes_null_and_its_inert_values_only():
    ok = decode_request(
        b'{"messages": [], "store": false, "modalities": ["text"], "audio": null, "length_penalty": 1,'
        b' "include_reasoning": true, "echo": false, "best_of": 1}',
        ChatCompletionRequest,
    )
    assert ok.store is False and ok.audio is None
    for body, param in [
        (b'{"messages": [], "store": true}', "store"),
        (b'{"messages": [], "modalities": ["text", "audio"]}', "modalities"),
        (b'{"messages": [], "length_penalty": 1.5}', "length_penalty"),
        (b'{"messages": [], "use_beam_search": 0}', "use_beam_search"),  # 0 is not false
        (b'{"messages": [], "best_of": true}', "best_of"),  # true is not 1
        (b'{"messages": [], "metadata": {}}', "metadata"),
    ]:
        with pytest.raises(RequestError) as info:
            decode_request(body, ChatCompletionRequest)
        assert info.value.param == param and str(info.value).startswith(f"{param} is not supported: ")
    # echo is honoured on completions, refused on chat.
    assert decode_request(b'{"prompt": "x", "echo": true}', CompletionRequest).echo is True


def test_max_tokens_zero_only_with_echo():
    scored = decode_request(b'{"prompt": "x", "echo": true, "max_tokens": 0, "logprobs": 1}', CompletionRequest)
    assert scored.scores_only and scored.sampling_params().prompt_logprobs == 1
    with pytest.raises(RequestError) as info:
        decode_request(b'{"prompt": "x", "max_tokens": 0}', CompletionRequest).sampling_params()
    assert info.value.param == "max_tokens" and "echo" in str(info.value)


DOCS = Path(__file__).resolve().parents[2] / "docs" / "openai_fields.md"


def docs_table(endpoint: str) -> dict[str, tuple[str, str]]:
    """The field -> (status, passes) rows of the docs' table under `## <endpoint>`."""
    section = DOCS.read_text().split(f"## {endpoint}\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            assert cells[0] not in rows, f"{cells[0]} twice in the {endpoint} table"
            rows[cells[0].strip("`")] = (cells[1], cells[3])
    return rows


@pytest.mark.parametrize(
    "endpoint, kind", [("/v1/completions", CompletionRequest), ("/v1/chat/completions", ChatCompletionRequest)]
)
def test_the_docs_table_lists_every_declared_field_as_it_is_handled(endpoint: str, kind: type):
    table = docs_table(endpoint)
    assert set(table) == {f.name for f in msgspec.structs.fields(kind)}
    assert {name for name, (status, _) in table.items() if status == "refused"} == set(kind.refused)
    assert {status for status, _ in table.values()} == {"honoured", "refused"}
    for name, refusal in kind.refused.items():  # the values that pass, as the struct lets them
        passes = table[name][1]
        assert [json.loads(v.strip("`")) for v in passes.split(",") if v] == list(refusal.inert), name
