"""SamplingParams: defaults, normalisation, validation errors naming the parameter, the wire."""

from __future__ import annotations

import math

import msgspec
import pytest

from sonar.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams


def test_defaults_follow_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.temperature) == (1, 16, 1.0)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    assert p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.greedy and SamplingParams(temperature=0).greedy
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_normalisation() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop="###").stop_strings == ["###"]
    assert SamplingParams().stop_strings == []
    assert SamplingParams(top_k=-1).top_k == 0


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ],
)
def test_out_of_range_values_name_the_parameter(kwargs: dict, param: str) -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert str(info.value).startswith(f"{param}:")
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "kwargs, limits, param",
    [
        ({"logprobs": 21}, {"max_logprobs": 20}, "logprobs"),
        ({"prompt_logprobs": 6}, {"max_logprobs": 5}, "prompt_logprobs"),
        ({"logit_bias": {100: 1.0}}, {"vocab_size": 100}, "logit_bias"),
        ({"stop_token_ids": [7, 100]}, {"vocab_size": 100}, "stop_token_ids"),
    ],
)
def test_engine_limits(kwargs: dict, limits: dict, param: str) -> None:
    p = SamplingParams(**kwargs)
    with pytest.raises(SamplingParamsError) as info:
        p.validate(**limits)
    assert info.value.param == param


def test_valid_values_pass_validate() -> None:
    SamplingParams(
        n=3,
        max_tokens=1,
        temperature=0.0,
        top_p=1.0,
        top_k=5,
        min_p=1.0,
        logit_bias={99: -100.0},
        stop_token_ids=[99],
        logprobs=20,
        prompt_logprobs=0,
    ).validate(max_logprobs=20, vocab_size=100)


def test_msgpack_and_json_round_trip() -> None:
    p = SamplingParams(n=2, stop=["a", "b"], logit_bias={3: -1.5}, seed=42, logprobs=3)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams) == p
    decoded = msgspec.json.decode(b'{"logit_bias": {"12": 3}, "stop": "x"}', type=SamplingParams)
    assert decoded.logit_bias == {12: 3.0} and decoded.stop == ["x"]


def test_decoding_invalid_values_fails_with_the_message() -> None:
    with pytest.raises(msgspec.ValidationError, match="temperature"):
        msgspec.json.decode(b'{"temperature": -1}', type=SamplingParams)


def test_children_get_consecutive_seeds() -> None:
    p = SamplingParams(n=3, seed=10, temperature=0.5)
    children = [p.for_child(i) for i in range(3)]
    assert [c.seed for c in children] == [10, 11, 12]
    assert all(c.n == 1 and c.temperature == 0.5 for c in children)
    assert SamplingParams(n=2).for_child(1).seed is None


def test_structured_outputs_may_be_given_as_a_dict_of_its_fields() -> None:
    params = SamplingParams(structured_outputs={"choice": ["yes", "no"]})
    assert params.structured_outputs == StructuredOutputsParams(choice=["yes", "no"])
    with pytest.raises(SamplingParamsError, match="structured_outputs: .*'chioce'"):
        SamplingParams(structured_outputs={"chioce": ["yes"]})
    with pytest.raises(SamplingParamsError, match="structured_outputs: must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs="yes|no")
