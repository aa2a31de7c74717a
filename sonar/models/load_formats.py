"""The load formats Sonar reads (``--load-format``) and their settings (``--model-loader-extra-config``,
``--safetensors-load-strategy``); free of torch, so the server checks these flags before it
imports torch (`sonar.engine.settings`). `sonar.models.loader` says what each format does.
"""

from __future__ import annotations

from typing import Any

from sonar.models.errors import ModelLoadError

LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy", "runai_streamer")
LOADER_EXTRA: dict[str, dict[str, Any]] = {"runai_streamer": {"concurrency": 8}}
"""Each load format's settings and their defaults: ``concurrency`` is the reader threads of
``runai_streamer``."""
SAFETENSORS_STRATEGIES = ("lazy", "eager")
"""``--safetensors-load-strategy`` values Sonar implements (unset means ``lazy``)."""


def check_load_format(load_format: str) -> None:
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(f"load_format {load_format!r} is not supported ({', '.join(LOAD_FORMATS)})")


def loader_extra(load_format: str, given: dict[str, Any]) -> dict[str, Any]:
    """The load format's settings: its defaults with `given` over them; a setting the format does
    not have is refused by name."""
    defaults = LOADER_EXTRA.get(load_format, {})
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        takes = f"it takes {', '.join(defaults)}" if defaults else "it takes none"
        raise ModelLoadError(f"model_loader_extra_config: load_format {load_format} has no setting {unknown} ({takes})")
    merged = {**defaults, **given}
    concurrency = merged.get("concurrency")
    if concurrency is not None and (
        isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1
    ):
        raise ModelLoadError(f"model_loader_extra_config: concurrency must be a positive integer, got {concurrency!r}")
    return merged


def safetensors_strategy(strategy: str | None) -> str:
    """The strategy `strategy` (None: ``lazy``) names; one Sonar does not implement is refused."""
    chosen = strategy or "lazy"
    if chosen not in SAFETENSORS_STRATEGIES:
        raise ModelLoadError(
            f"safetensors_load_strategy {chosen!r} is not supported ({', '.join(SAFETENSORS_STRATEGIES)})"
        )
    return chosen
