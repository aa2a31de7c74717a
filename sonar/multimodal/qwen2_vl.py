"""Qwen2-VL / Qwen2.5-VL preprocessing: dynamic resolution, patches and their grid.

transformers' `Qwen2VLImageProcessorPil` (from the model folder's ``preprocessor_config.json``,
else from the tower's patch sizes) resizes each image so that both sides are multiples of
``patch_size * merge_size`` and its area lies within ``[min_pixels, max_pixels]`` (its
``smart_resize``, keeping the aspect ratio), rescales and normalizes it, repeats it
``temporal_patch_size`` times over time and cuts it into patches, each ``merge_size x merge_size``
block of patches consecutive. The image takes ``t * h * w / merge_size ** 2`` placeholder tokens
for its grid of patches ``(t, h, w)``. ``--mm-processor-kwargs`` may set ``min_pixels`` and
``max_pixels`` (and the other settings of `PROCESSOR_KWARGS` without a crop: the processor has none).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sonar.multimodal.limits import ProcessorConfigError
from sonar.protocol.engine import VisionInfo

#: Settings this processor has no use for (it never crops).
NO_CROP = ("do_center_crop", "crop_size")

#: What ``--mm-processor-kwargs`` names ``min_pixels`` / ``max_pixels`` are in the processor's size.
_SIZE_KEYS = {"min_pixels": "shortest_edge", "max_pixels": "longest_edge"}


class GridImageProcessor:
    """Patches and their grid for a dynamic-resolution model (see the module docstring)."""

    def __init__(self, vision: VisionInfo, model_dir: str | Path | None, overrides: dict[str, Any]) -> None:
        from transformers import Qwen2VLImageProcessorPil

        cropping = sorted(set(overrides) & set(NO_CROP))
        if cropping:
            raise ProcessorConfigError(
                f"--mm-processor-kwargs: {', '.join(cropping)} do not apply to this model's processor (it does not crop)"
            )
        overrides = dict(overrides)
        for key in _SIZE_KEYS:
            value = overrides.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ProcessorConfigError(
                    f"--mm-processor-kwargs: {key} must be a positive number of pixels, got {value!r}"
                )
        shape = {
            "patch_size": vision.patch_size,
            "merge_size": vision.merge_size,
            "temporal_patch_size": vision.temporal_patch_size,
        }
        found = model_dir is not None and (Path(model_dir) / "preprocessor_config.json").is_file()
        if found:
            self.processor = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir), **overrides)
        else:
            self.processor = Qwen2VLImageProcessorPil(**shape, **overrides)
        have = {key: getattr(self.processor, key) for key in shape}
        if have != shape:
            raise ProcessorConfigError(f"the image processor's {have} do not match the vision tower's {shape}")
        size = self.processor.size
        low, high = size["shortest_edge"], size["longest_edge"]
        if low > high:
            raise ProcessorConfigError(f"--mm-processor-kwargs: min_pixels {low} is above max_pixels {high}")
        self.vision = vision

    def pixels(self, image: Any) -> tuple[Any, list[int]]:
        """A PIL image's patches (float32 ``[t * h * w, 3 * temporal_patch_size * patch_size ** 2]``)
        and their grid ``[t, h, w]``. Blocking."""
        out = self.processor(images=[image], return_tensors="pt")
        return out["pixel_values"].float().contiguous(), [int(v) for v in out["image_grid_thw"][0]]
