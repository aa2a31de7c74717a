"""`--structured-outputs-config`: the server's structured output settings, refused key by key.

vLLM's `StructuredOutputsConfig` keys. With a reasoning parser (`reasoning_parser`, which
`serve --reasoning-parser` also sets), a request's grammar applies only once the model's thinking
has ended (`sonar.core.thinking`), unless `enable_in_reasoning`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from sonar.parsers import ParserError, load_plugin
from sonar.parsers.reasoning import ReasoningFormat, reasoning_format

BACKENDS = ("auto", "xgrammar", "guidance")

_REASONING_KEYS = ("reasoning_parser", "reasoning_parser_plugin", "enable_in_reasoning")


class StructuredOutputsConfig(msgspec.Struct, frozen=True, kw_only=True):
    backend: str = "auto"
    """Which library compiles grammars: ``xgrammar``, ``guidance`` (llguidance), or ``auto``
    (xgrammar, and llguidance for what xgrammar cannot express)."""
    disable_any_whitespace: bool = False
    """Compact JSON: no whitespace the schema does not require, for every request."""
    disable_additional_properties: bool = False
    """JSON objects carry only the properties their schema lists, for every request. (xgrammar
    always does so when a schema leaves ``additionalProperties`` out: its strict mode.)"""
    reasoning_parser: str = ""
    """A reasoning parser's name (`sonar.parsers.reasoning`): the grammar waits for the end of
    the thinking it delimits. Empty: no reasoning parser, the grammar applies from the start."""
    reasoning_parser_plugin: str = ""
    """A Python file that registers `reasoning_parser` (loaded in every process that reads this
    config: the scheduler may run in its own)."""
    enable_in_reasoning: bool = False
    """Apply the grammar from the first token even with a reasoning parser (the thinking is
    then constrained too)."""

    @classmethod
    def parse(cls, raw: dict[str, Any] | None) -> "StructuredOutputsConfig":
        """The config of a `--structured-outputs-config` object; ValueError naming a key or value
        that is unknown or not supported."""
        # vLLM writes None for "no reasoning parser"
        raw = {k: v for k, v in (raw or {}).items() if not (k in _REASONING_KEYS and v is None)}
        unknown = sorted(set(raw) - set(cls.__struct_fields__))
        if unknown:
            known = ", ".join(cls.__struct_fields__)
            raise ValueError(f"structured_outputs_config: unknown key(s) {', '.join(unknown)} (known: {known})")
        if "backend" in raw and raw["backend"] not in BACKENDS:
            raise ValueError(
                f"structured_outputs_config.backend={raw['backend']!r} is not one of {', '.join(BACKENDS)}"
            )
        try:
            config = msgspec.convert(raw, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"structured_outputs_config: {exc}") from None
        config.thinking_ends()
        return config

    def thinking_ends(self) -> tuple[str, ...]:
        """The markers after which a request's grammar applies; empty when it applies from the
        start (no reasoning parser, or `enable_in_reasoning`)."""
        fmt = self.thinking_format()
        return tuple(fmt.ends) if fmt is not None else ()

    def thinking_format(self) -> ReasoningFormat | None:
        """The reasoning format whose thinking a request's grammar waits out; None when it
        applies from the start (no reasoning parser, or `enable_in_reasoning`). Loads the plugin,
        once per process; ValueError naming the key when the plugin or the parser name is wrong."""
        self._load_plugin()
        if not self.reasoning_parser:
            return None
        try:
            fmt = reasoning_format(self.reasoning_parser)
        except ParserError as exc:
            raise ValueError(f"structured_outputs_config.reasoning_parser: {exc}") from None
        if not fmt.ends:
            raise ValueError(
                f"structured_outputs_config.reasoning_parser: {self.reasoning_parser!r} names no end of thinking"
            )
        return None if self.enable_in_reasoning else fmt

    def _load_plugin(self) -> None:
        if self.reasoning_parser_plugin:
            try:
                load_plugin(self.reasoning_parser_plugin)
            except ParserError as exc:
                raise ValueError(f"structured_outputs_config.reasoning_parser_plugin: {exc}") from None
