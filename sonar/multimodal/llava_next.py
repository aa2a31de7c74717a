"""LLaVA-NeXT preprocessing: an image's any-resolution tiles and its token count.

transformers' `LlavaNextImageProcessorPil` (from the model folder's ``preprocessor_config.json``,
else from the tower's input size and the model's ``image_grid_pinpoints``) resizes the image into
its best-fit pinpoint resolution, pads it, cuts it into tiles of the tower's input size and puts
the whole image resized to one tile first; each tile is rescaled and normalized. The image takes
`sonar.core.anyres.feature_rows` placeholder tokens for its original size, the count transformers'
`LlavaNextProcessor` gives. ``--mm-processor-kwargs`` may override the CLIP-style settings; the
tiles must stay of the tower's input size and the pinpoints the model's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sonar.multimodal.limits import DYNAMIC_ONLY, ProcessorConfigError
from sonar.protocol.engine import VisionInfo


class TileImageProcessor:
    """Tiles and the original size of an image for an any-resolution model (see the module docstring)."""

    def __init__(self, vision: VisionInfo, model_dir: str | Path | None, overrides: dict[str, Any]) -> None:
        from transformers import LlavaNextImageProcessorPil

        dynamic = sorted(set(overrides) & set(DYNAMIC_ONLY))
        if dynamic:
            raise ProcessorConfigError(
                f"--mm-processor-kwargs: {', '.join(dynamic)} apply to dynamic-resolution models (Qwen2-VL), not this one"
            )
        side = vision.image_size
        found = model_dir is not None and (Path(model_dir) / "preprocessor_config.json").is_file()
        if found:
            self.processor = LlavaNextImageProcessorPil.from_pretrained(str(model_dir), **overrides)
        else:
            defaults = {
                "size": {"shortest_edge": side},
                "crop_size": {"height": side, "width": side},
                "image_grid_pinpoints": vision.grid_pinpoints,
            }
            self.processor = LlavaNextImageProcessorPil(**{**defaults, **overrides})
        crop, size = self.processor.crop_size, self.processor.size
        sides = {_side(crop, "height"), _side(crop, "width")}
        sides |= (
            {_side(size, "shortest_edge")}
            if _side(size, "shortest_edge")
            else {_side(size, "height"), _side(size, "width")}
        )
        if sides != {side}:
            raise ProcessorConfigError(
                f"the image processor must cut and resize to tiles of the vision tower's {side}x{side} input "
                f"(crop_size {dict(crop) if crop else crop}, size {dict(size) if size else size})"
            )
        pinpoints = [list(point) for point in self.processor.image_grid_pinpoints]
        if pinpoints != vision.grid_pinpoints:
            raise ProcessorConfigError(
                f"the image processor's image_grid_pinpoints {pinpoints} are not the model's {vision.grid_pinpoints}"
            )
        self.vision = vision

    def pixels(self, image: Any) -> tuple[Any, list[int]]:
        """A PIL image's tiles (float32 ``[n, 3, side, side]``, the base image first) and its
        ``[height, width]``. Blocking."""
        out = self.processor(images=[image], return_tensors="pt")
        return out["pixel_values"][0].float().contiguous(), [int(v) for v in out["image_sizes"][0]]


def _side(size: Any, key: str) -> int | None:
    value = size.get(key) if isinstance(size, dict) else getattr(size, key, None)
    return None if value is None else int(value)
