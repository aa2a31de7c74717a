"""What the structured output tests share: the embedded model's tokenizer, a compiler over it, and
helpers to compile a spec and to feed a matcher a text."""

from __future__ import annotations

import pytest

from sonar.models.embedded import tokenizer_dir
from sonar.sampling_params import StructuredOutputsParams
from sonar.structured import StructuredOutputsConfig
from sonar.structured.compiler import GrammarCompiler

VOCAB = 49152
EOS = 2
LIMITS = dict(max_chars=10_000, timeout=30.0)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir()))


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB, [EOS])


def compile_(compiler: GrammarCompiler, config: StructuredOutputsConfig | None = None, **spec):
    return compiler.compile_sync(StructuredOutputsParams(**spec), config or StructuredOutputsConfig(), **LIMITS)


def run(matcher, tokenizer, text: str) -> bool:
    """Feed the text's tokens to the matcher; False at the first it refuses."""
    return all(matcher.accept_token(t) for t in tokenizer(text, add_special_tokens=False).input_ids)
