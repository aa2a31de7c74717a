"""`--structured-outputs-config`: the server's structured output settings, refused key by key.

vLLM's `StructuredOutputsConfig` keys are accepted; those Sonar does not implement
(`reasoning_parser`, `reasoning_parser_plugin`, `enable_in_reasoning`) only at their defaults.
"""

from __future__ import annotations

from typing import Any

import msgspec

BACKENDS = ("auto", "xgrammar", "guidance")

_NOT_YET = {
    "reasoning_parser": "",
    "reasoning_parser_plugin": "",
    "enable_in_reasoning": False,
}


class StructuredOutputsConfig(msgspec.Struct, frozen=True, kw_only=True):
    backend: str = "auto"
    """Which library compiles grammars: ``xgrammar``, ``guidance`` (llguidance), or ``auto``
    (xgrammar, and llguidance for what xgrammar cannot express)."""
    disable_any_whitespace: bool = False
    """Compact JSON: no whitespace the schema does not require, for every request."""
    disable_additional_properties: bool = False
    """JSON objects carry only the properties their schema lists, for every request. (xgrammar
    always does so when a schema leaves ``additionalProperties`` out: its strict mode.)"""

    @classmethod
    def parse(cls, raw: dict[str, Any] | None) -> "StructuredOutputsConfig":
        """The config of a `--structured-outputs-config` object; ValueError naming a key or value
        that is unknown or not supported."""
        raw = dict(raw or {})
        for key, default in _NOT_YET.items():
            if key in raw:
                value = raw.pop(key)
                if value not in (default, None):
                    raise ValueError(
                        f"structured_outputs_config.{key}={value!r} is not supported yet (only {default!r})"
                    )
        unknown = sorted(set(raw) - set(cls.__struct_fields__))
        if unknown:
            known = ", ".join([*cls.__struct_fields__, *_NOT_YET])
            raise ValueError(f"structured_outputs_config: unknown key(s) {', '.join(unknown)} (known: {known})")
        if "backend" in raw and raw["backend"] not in BACKENDS:
            raise ValueError(
                f"structured_outputs_config.backend={raw['backend']!r} is not one of {', '.join(BACKENDS)}"
            )
        try:
            return msgspec.convert(raw, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"structured_outputs_config: {exc}") from None
