"""Structured outputs: grammars compiled from `StructuredOutputsParams` by xgrammar or llguidance,
cached per tokenizer, the matchers the scheduler core advances (`sonar.core.grammar`) and the
token bitmask the worker applies before sampling.

The names below are imported on first use: the flags' parser reads `sonar.structured.config`
without importing torch (the bitmask's) on the way."""

from __future__ import annotations

from sonar.lazy import lazy_exports

_EXPORTS = {
    "BACKENDS": "sonar.structured.config",
    "CompiledGrammar": "sonar.structured.backends",
    "GrammarCompiler": "sonar.structured.compiler",
    "GrammarError": "sonar.structured.backends",
    "StructuredOutputsConfig": "sonar.structured.config",
    "allocate_bitmask": "sonar.structured.bitmask",
    "apply_token_bitmask": "sonar.structured.bitmask",
    "bitmask_words": "sonar.structured.bitmask",
    "compiler_for": "sonar.structured.compiler",
    "fill_bitmasks": "sonar.structured.backends",
    "fill_draft_bitmasks": "sonar.structured.backends",
    "pack_allowed": "sonar.structured.bitmask",
    "unpack_allowed": "sonar.structured.bitmask",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS, globals())
