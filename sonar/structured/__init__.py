"""Structured outputs: grammars compiled from `StructuredOutputsParams` by xgrammar or llguidance,
cached per tokenizer, the matchers the scheduler core advances (`sonar.core.grammar`) and the
token bitmask the worker applies before sampling.

The names below are imported on first use: the flags' parser reads `sonar.structured.config`
without importing torch (the bitmask's) on the way."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BACKENDS": "config",
    "CompiledGrammar": "backends",
    "GrammarCompiler": "compiler",
    "GrammarError": "backends",
    "StructuredOutputsConfig": "config",
    "allocate_bitmask": "bitmask",
    "apply_token_bitmask": "bitmask",
    "bitmask_words": "bitmask",
    "compiler_for": "compiler",
    "fill_bitmasks": "backends",
    "pack_allowed": "bitmask",
    "unpack_allowed": "bitmask",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
