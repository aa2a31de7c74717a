"""An image model's preprocessing: pixels from an image, placeholder tokens in the prompt.

The pixels come from the model's CLIP image processor (transformers' `CLIPImageProcessorPil`,
built from the model folder's ``preprocessor_config.json``, else from the tower's image size):
resize, center crop, rescale, normalize. ``--mm-processor-kwargs`` overrides its settings; those
that would change the pixels' shape (``size``, ``crop_size``) must keep the tower's input size.

A chat prompt holds one image token per image where the message had it; `expand_images`
repeats each as many times as the image has feature rows (what transformers' `LlavaProcessor`
does to the text) and records where each image's tokens are. An image's hash is the SHA-256 of
its pixels, so two requests with the same picture share prefix-cache blocks.

A dynamic-resolution model (Qwen2-VL, `VisionInfo.patch_size` set) takes its pixels from
`sonar.multimodal.qwen2_vl` instead (`image_processor` picks): patches and their grid, an image's
token count following from its grid. An any-resolution model (LLaVA-NeXT, `VisionInfo.grid_pinpoints`
set) takes its tiles from `sonar.multimodal.llava_next`, an image's token count following from
its original size (`sonar.core.anyres`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sonar.core.anyres import feature_rows
from sonar.errors import InvalidRequestError
from sonar.multimodal.limits import DYNAMIC_ONLY, ProcessorConfigError, check_processor_kwargs
from sonar.protocol.engine import ImageInput, VisionInfo


def image_processor(vision: VisionInfo, model_dir: str | Path | None, overrides: dict[str, Any] | None) -> Any:
    """The processor for `vision`'s model: `ImageProcessor` (one input size), Gemma 3's
    (`sonar.multimodal.gemma3`), the dynamic-resolution `GridImageProcessor` or the any-resolution
    `TileImageProcessor`; all have ``pixels(image)``, whose results `expand_images` takes."""
    if vision.processor == "gemma3":
        from sonar.multimodal.gemma3 import Gemma3ImageProcessor

        return Gemma3ImageProcessor(vision, model_dir, overrides)
    if vision.grid_pinpoints:
        check_processor_kwargs(overrides)
        from sonar.multimodal.llava_next import TileImageProcessor

        return TileImageProcessor(vision, model_dir, dict(overrides or {}))
    if not vision.patch_size:
        return ImageProcessor(vision, model_dir, overrides)
    check_processor_kwargs(overrides)
    from sonar.multimodal.qwen2_vl import GridImageProcessor

    return GridImageProcessor(vision, model_dir, dict(overrides or {}))


class ImageProcessor:
    """Pixels for one image model (see the module docstring)."""

    def __init__(self, vision: VisionInfo, model_dir: str | Path | None, overrides: dict[str, Any] | None) -> None:
        overrides = dict(overrides or {})
        check_processor_kwargs(overrides)
        dynamic = sorted(set(overrides) & set(DYNAMIC_ONLY))
        if dynamic:
            raise ProcessorConfigError(
                f"--mm-processor-kwargs: {', '.join(dynamic)} apply to dynamic-resolution models (Qwen2-VL), not this one"
            )
        from transformers import CLIPImageProcessorPil

        side = vision.image_size
        found = model_dir is not None and (Path(model_dir) / "preprocessor_config.json").is_file()
        if found:
            self.processor = CLIPImageProcessorPil.from_pretrained(str(model_dir), **overrides)
        else:
            defaults = {"size": {"shortest_edge": side}, "crop_size": {"height": side, "width": side}}
            self.processor = CLIPImageProcessorPil(**{**defaults, **overrides})
        self.vision = vision
        crop = self.processor.crop_size
        crop_side = (crop.get("height"), crop.get("width")) if isinstance(crop, dict) else (crop.height, crop.width)
        if not self.processor.do_center_crop or crop_side != (side, side):
            raise ProcessorConfigError(
                f"the image processor must center-crop to the vision tower's {side}x{side} input "
                f"(do_center_crop {self.processor.do_center_crop}, crop_size {crop_side})"
            )

    def pixels(self, image: Any) -> Any:
        """A PIL image's pixels: a float32 tensor ``[3, image_size, image_size]``. Blocking."""
        out = self.processor(images=[image], return_tensors="pt")
        return out["pixel_values"][0].float().contiguous()


@dataclass(frozen=True)
class ImageEmbeds:
    """An image given as its feature rows (--enable-mm-embeds, `sonar.engine.image_embeds`): a
    float32 CPU tensor ``[rows, hidden_size]`` and, for a dynamic-resolution model, the grid of
    patches ``(t, h, w)`` they stand for (which places the rows' M-RoPE positions)."""

    rows: Any
    grid: tuple[int, int, int] | None = None


@dataclass(frozen=True)
class Processed:
    """A picture the processor has already made into pixels (`LLM.prepare_image`): its
    ``pixels(image)`` result, which `LLM.add_images` passes on as is."""

    value: Any


def image_hash(pixels: Any, grid: Sequence[int] | None = None) -> str:
    """The content hash that keys an image's prefix-cache blocks (its grid too, where it has one:
    the same values cut another way are another image)."""
    digest = hashlib.sha256(pixels.numpy().tobytes())
    if grid is not None:
        digest.update(repr(list(grid)).encode())
    return digest.hexdigest()


def expand_images(
    prompt_ids: Sequence[int], vision: VisionInfo, pixels: Sequence[Any]
) -> tuple[list[int], list[ImageInput]]:
    """The prompt with each image token repeated once per feature row, and each image's place;
    `pixels` are the images' in prompt order (a dynamic-resolution model's: ``(patches, grid)``
    pairs, an any-resolution model's ``(tiles, size)`` pairs; `ImageEmbeds` for an image given as
    its feature rows). An `InvalidRequestError` when
    the prompt holds a different number of image tokens than there are images."""
    token, n = vision.image_token_id, vision.tokens_per_image
    found = sum(1 for t in prompt_ids if t == token)
    if found != len(pixels):
        raise InvalidRequestError(
            f"the prompt holds {found} image placeholder(s) for {len(pixels)} image(s): the text must not "
            "contain the model's image token itself",
            param="messages",
        )
    ids: list[int] = []
    images: list[ImageInput] = []
    for t in prompt_ids:
        if t == token:
            px = pixels[len(images)]
            if isinstance(px, ImageEmbeds):
                images.append(_embeds_input(px, vision, len(ids), f"image_embeds[{len(images)}]"))
                ids += [token] * images[-1].length
                continue
            if vision.grid_pinpoints:
                px, size = px
                rows = feature_rows(
                    (size[0], size[1]), vision.grid_pinpoints, vision.image_size, vision.tile_patch_size
                )
                images.append(ImageInput(len(ids), rows, image_hash(px, size), px, list(size)))
                ids += [token] * rows
                continue
            if vision.patch_size:
                px, grid = px
                rows = grid[0] * grid[1] * grid[2] // vision.merge_size**2
                images.append(ImageInput(len(ids), rows, image_hash(px, grid), px, list(grid)))
                ids += [token] * rows
                continue
            images.append(ImageInput(len(ids), n, image_hash(px), px))
            ids += [token] * n
        else:
            ids.append(t)
    return ids, images


def _embeds_input(embeds: ImageEmbeds, vision: VisionInfo, offset: int, param: str) -> ImageInput:
    """The `ImageInput` of an image given as feature rows at `offset`, or a 400 when their count
    is not what the model's placeholder takes (a grid for a dynamic-resolution model)."""
    rows = embeds.rows.shape[0]
    if vision.patch_size:
        if embeds.grid is None:
            raise InvalidRequestError(f"{param}: this model's image embeddings need their image_grid_thw", param)
        t, h, w = embeds.grid
        merge = vision.merge_size
        if t != 1 or h % merge or w % merge:
            raise InvalidRequestError(
                f"{param}: image_grid_thw must be (1, h, w) with h and w multiples of {merge}, got {embeds.grid}", param
            )
        want = t * h * w // merge**2
    elif embeds.grid is not None:
        raise InvalidRequestError(f"{param}: image_grid_thw applies to dynamic-resolution models only", param)
    elif vision.grid_pinpoints:  # the rows say how large the image was: any count fits
        want = rows
    else:
        want = vision.tokens_per_image
    if rows != want:
        raise InvalidRequestError(f"{param} has {rows} rows, the model's image placeholder takes {want}", param)
    digest = hashlib.sha256(b"embeds")  # never the key of pixels that happen to share the bytes
    digest.update(embeds.rows.numpy().tobytes())
    digest.update(repr(embeds.grid).encode())
    grid = list(embeds.grid) if embeds.grid is not None else None
    return ImageInput(offset, rows, digest.hexdigest(), embeds.rows, grid, embeds=True)
