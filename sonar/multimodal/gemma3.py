"""Gemma 3's image preprocessing: every picture resized to the SigLIP tower's square, no crop.

transformers' `Gemma3ImageProcessorPil`, built from the model folder's ``preprocessor_config.json``
(else from the tower's size, with Gemma 3's defaults: mean and std 0.5), with
``--mm-processor-kwargs`` over it. Pan-and-scan (``do_pan_and_scan``: extra crops of a wide
picture, each another image in the prompt) is refused by name: Sonar gives each picture exactly
``mm_tokens_per_image`` rows. A ``size`` other than the tower's square is refused too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sonar.multimodal.limits import DYNAMIC_ONLY, ProcessorConfigError, check_processor_kwargs
from sonar.protocol.engine import VisionInfo

#: Settings of CLIP's processor that Gemma 3's does not have.
CROP = ("do_center_crop", "crop_size")


class Gemma3ImageProcessor:
    """Pixels for Gemma 3 (see the module docstring); ``pixels(image)`` as `ImageProcessor`'s."""

    def __init__(self, vision: VisionInfo, model_dir: str | Path | None, overrides: dict[str, Any] | None) -> None:
        overrides = dict(overrides or {})
        check_processor_kwargs(overrides)
        foreign = sorted(set(overrides) & {*DYNAMIC_ONLY, *CROP})
        if foreign:
            raise ProcessorConfigError(
                f"--mm-processor-kwargs: {', '.join(foreign)} do not apply to Gemma 3's image processor (no crop, "
                "one input size)"
            )
        from transformers import Gemma3ImageProcessorPil

        side = vision.image_size
        if model_dir is not None and (Path(model_dir) / "preprocessor_config.json").is_file():
            self.processor = Gemma3ImageProcessorPil.from_pretrained(str(model_dir), **overrides)
        else:
            self.processor = Gemma3ImageProcessorPil(**{"size": {"height": side, "width": side}, **overrides})
        if self.processor.do_pan_and_scan:
            raise ProcessorConfigError(
                "Gemma 3 do_pan_and_scan is not supported (Sonar gives each picture one image's rows); "
                "set it false in preprocessor_config.json"
            )
        size = self.processor.size
        got = (size.get("height"), size.get("width")) if isinstance(size, dict) else (size.height, size.width)
        if not self.processor.do_resize or got != (side, side):
            raise ProcessorConfigError(
                f"the image processor must resize to the vision tower's {side}x{side} input "
                f"(do_resize {self.processor.do_resize}, size {got})"
            )

    def pixels(self, image: Any) -> Any:
        """A PIL image's pixels: a float32 tensor ``[3, image_size, image_size]``. Blocking."""
        out = self.processor(images=[image], return_tensors="pt")
        return out["pixel_values"][0].float().contiguous()
