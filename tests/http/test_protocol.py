"""How request bodies become prompts and sampling parameters (the request decoding core)."""

from __future__ import annotations

from typing import Any

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
        b' "temperature": null, "top_k": -1, "ignore_eos": true, "extra": {"a": 1}}',
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
    with pytest.raises(RequestError) as info:
        chat.template_messages()
    assert info.value.param == "messages"
