"""How many images a prompt may hold (``--limit-mm-per-prompt``, ``--language-model-only``), and
which image processor settings ``--mm-processor-kwargs`` may override.

Only a count per modality is applied (the documented default, 999, for a modality not named);
the per-item size options of the configurable format are refused, as is an unknown modality.
Checked when the engine's config is (a bad value fails at startup).
"""

from __future__ import annotations

from typing import Any

from sonar.errors import InvalidRequestError

#: --limit-mm-per-prompt's default for each modality, as documented.
DEFAULT_LIMIT = 999
MODALITIES = ("image", "video", "audio")


#: Settings of the image processor (CLIP's, or Qwen2-VL's) that --mm-processor-kwargs may override.
PROCESSOR_KWARGS = (
    "do_resize",
    "size",
    "resample",
    "do_center_crop",
    "crop_size",
    "do_rescale",
    "rescale_factor",
    "do_normalize",
    "image_mean",
    "image_std",
    "do_convert_rgb",
    "min_pixels",
    "max_pixels",
)

#: Of those, the settings only a dynamic-resolution processor (Qwen2-VL's) has.
DYNAMIC_ONLY = ("min_pixels", "max_pixels")


class ProcessorConfigError(InvalidRequestError):
    """--mm-processor-kwargs, --media-io-kwargs or --limit-mm-per-prompt is not one Sonar can apply."""


def image_limit(limit_mm_per_prompt: dict[str, Any], language_model_only: bool = False) -> int:
    """Most images one prompt may hold (`--limit-mm-per-prompt`, `--language-model-only`); raise
    `ProcessorConfigError` for a limit Sonar cannot apply."""
    for modality, value in limit_mm_per_prompt.items():
        if modality not in MODALITIES:
            raise ProcessorConfigError(
                f"--limit-mm-per-prompt: unknown modality {modality!r} ({', '.join(MODALITIES)})"
            )
        count = value.get("count", DEFAULT_LIMIT) if isinstance(value, dict) else value
        if isinstance(value, dict) and set(value) - {"count"}:
            raise ProcessorConfigError(
                f"--limit-mm-per-prompt: {modality} options {sorted(set(value) - {'count'})} are not supported "
                "yet (only a count)"
            )
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ProcessorConfigError(f"--limit-mm-per-prompt: {modality} must be a count >= 0, got {count!r}")
    if language_model_only:
        return 0
    value = limit_mm_per_prompt.get("image", DEFAULT_LIMIT)
    return int(value.get("count", DEFAULT_LIMIT) if isinstance(value, dict) else value)


def check_processor_kwargs(overrides: dict[str, Any] | None) -> None:
    """Refuse --mm-processor-kwargs keys the image processor does not have."""
    unknown = sorted(set(overrides or {}) - set(PROCESSOR_KWARGS))
    if unknown:
        raise ProcessorConfigError(
            f"--mm-processor-kwargs: {', '.join(unknown)} not supported (the image processor takes "
            f"{', '.join(PROCESSOR_KWARGS)})"
        )
