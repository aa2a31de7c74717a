"""Structured outputs: grammars compiled from `StructuredOutputsParams` by xgrammar or llguidance,
cached per tokenizer, the matchers the scheduler core advances (`sonar.core.grammar`) and the
token bitmask the worker applies before sampling."""

from sonar.structured.backends import CompiledGrammar, GrammarError, fill_bitmasks
from sonar.structured.bitmask import (
    allocate_bitmask,
    apply_token_bitmask,
    bitmask_words,
    pack_allowed,
    unpack_allowed,
)
from sonar.structured.compiler import GrammarCompiler, compiler_for
from sonar.structured.config import BACKENDS, StructuredOutputsConfig

__all__ = [
    "BACKENDS",
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarError",
    "StructuredOutputsConfig",
    "allocate_bitmask",
    "apply_token_bitmask",
    "bitmask_words",
    "compiler_for",
    "fill_bitmasks",
    "pack_allowed",
    "unpack_allowed",
]
