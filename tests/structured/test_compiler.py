"""The compile cache over the embedded model's tokenizer: one compile per spec and backend, the
size and time limits, one compiler per tokenizer in a process."""

from __future__ import annotations

import json

import anyio
import pytest

from sonar.errors import InvalidRequestError
from sonar.models.embedded import tokenizer_dir
from sonar.sampling_params import StructuredOutputsParams
from sonar.structured import StructuredOutputsConfig, compiler_for
from tests.structured.conftest import EOS, VOCAB, compile_


def test_the_cache_compiles_each_spec_once_per_backend(compiler) -> None:
    schema = {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}
    before = compiler.compiles
    first = compile_(compiler, json=schema)
    assert compile_(compiler, json=json.dumps(schema)) is first  # the same spec as text
    assert compiler.compiles == before + 1
    assert compile_(compiler, json=schema, backend="guidance") is not first
    assert compile_(compiler, json=schema, disable_any_whitespace=True) is not first
    assert compiler.compiles == before + 3
    # a failure is cached too, and raised again without a compile
    for _ in range(2):
        with pytest.raises(InvalidRequestError, match="parenthes"):
            compile_(compiler, regex="(x")
    assert compiler.compiles == before + 4


def test_the_process_shares_one_compiler_per_tokenizer(tokenizer) -> None:
    path = str(tokenizer_dir())
    assert compiler_for(path, VOCAB, [EOS], tokenizer=tokenizer) is compiler_for(path, VOCAB, [EOS])
    assert compiler_for(path, VOCAB, [EOS]) is not compiler_for(path, VOCAB, [EOS, 0])


def test_limits_on_size_and_time(compiler) -> None:
    with pytest.raises(InvalidRequestError, match="max-structured-output-chars") as caught:
        compiler.compile_sync(
            StructuredOutputsParams(regex="a" * 101), StructuredOutputsConfig(), max_chars=100, timeout=5
        )
    assert caught.value.param == "structured_outputs"

    async def slow() -> None:
        schema = {
            "type": "object",
            "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{1,40}"} for i in range(60)},
        }
        params = StructuredOutputsParams(json=schema)
        with pytest.raises(InvalidRequestError, match="did not compile within 1e-06 s"):
            await compiler.compile(params, StructuredOutputsConfig(), max_chars=100_000, timeout=1e-6)
        # the compile went on in its thread, and is cached once done
        compiled = await compiler.compile(params, StructuredOutputsConfig(), max_chars=100_000, timeout=60)
        assert compiled is compiler.compile_sync(params, StructuredOutputsConfig(), max_chars=100_000, timeout=0)

    anyio.run(slow)
