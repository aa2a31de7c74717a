"""The largest image a vision model serves, made up for the startup memory profile.

On CUDA the worker measures what serving needs beside the KV cache before it sizes the cache
(`sonar.engine.memory`). A vision model's tower runs on one image at a time, whole, so its peak is
the tower's activations on the largest image a request can bring. That image depends on the
family's processor: a fixed-size tower (LLaVA, Gemma 3) takes every image at one size; a
dynamic-resolution one (Qwen2-VL and later) takes a grid of patches up to the processor's
``max_pixels``; an any-resolution one (LLaVA-NeXT) tiles the image into the largest of its
pinpoint resolutions. A request's image is also bounded by the tokens it may take: the model
length, or one step's budget where an image is computed in one step (Gemma 3).

The image is grey: the tower's memory does not depend on the values, only on the shape."""

from __future__ import annotations

import math
from typing import Any

from sonar.core.anyres import feature_rows
from sonar.multimodal.processor import expand_images
from sonar.protocol.engine import ImageInput, VisionInfo


def largest_image(vision: VisionInfo, processor: Any, max_rows: int) -> ImageInput | None:
    """The largest image (most feature rows, at most `max_rows`) that `processor` makes for
    `vision`'s model, as a request would carry it; None where no image fits (every image request
    is then refused, and the tower never runs)."""
    from PIL import Image

    if vision.grid_pinpoints:
        side = (vision.image_size, vision.tile_patch_size)
        fits = [
            (h, w) for h, w in vision.grid_pinpoints if feature_rows((h, w), vision.grid_pinpoints, *side) <= max_rows
        ]
        if not fits:
            return None
        h, w = max(fits, key=lambda hw: feature_rows(hw, vision.grid_pinpoints or [], *side))
        size = (w, h)
    elif vision.patch_size:
        # A square of k x k merged patches is k * k rows; the processor shrinks it under its
        # max_pixels where that binds.
        step = vision.patch_size * vision.merge_size
        k = math.isqrt(max_rows)
        if k == 0:
            return None
        size = (k * step, k * step)
    else:
        size = (vision.image_size, vision.image_size)
    pixels = processor.pixels(Image.new("RGB", size, (128, 128, 128)))
    _, images = expand_images([vision.image_token_id], vision, [pixels])
    return images[0] if images[0].length <= max_rows else None  # a processor's minimum size can exceed it
