"""A tiny random-weight LLaVA-NeXT checkpoint, built and saved by transformers at test time: the
tiny LLaVA's CLIP tower (16x16 tiles in 4x4 patches) and Llama, any-resolution pinpoints of one
to two tiles a side, the same word-level tokenizer and chat template, and a LLaVA-NeXT image
processor config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.multimodal.tiny_llava import IMAGE_SIZE, IMAGE_TOKEN_ID, llava_config, save_weights_and_tokenizer

PINPOINTS = [[16, 32], [32, 16], [32, 32]]

#: Pictures of two aspect ratios (width, height): a wide one tiled 1x2 (52 rows), a tall one
#: tiled 2x2 whose feature map loses half its columns to the padding (56 rows).
WIDE, TALL = (40, 20), (18, 30)


def llava_next_config() -> Any:
    from transformers import LlavaNextConfig

    base = llava_config()
    return LlavaNextConfig(
        vision_config=base.vision_config,
        text_config=base.text_config,
        image_token_index=IMAGE_TOKEN_ID,
        image_grid_pinpoints=PINPOINTS,
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        architectures=["LlavaNextForConditionalGeneration"],
    )


def save_tiny_llava_next(path: Path, seed: int = 0) -> Any:
    """Save a tiny LLaVA-NeXT checkpoint with its tokenizer and image processor under `path`;
    return the transformers model (float32, eval mode)."""
    from transformers import LlavaNextForConditionalGeneration, LlavaNextImageProcessorPil

    torch.manual_seed(seed)
    hf = LlavaNextForConditionalGeneration(llava_next_config()).eval()
    save_weights_and_tokenizer(path, hf)
    LlavaNextImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        image_grid_pinpoints=PINPOINTS,
    ).save_pretrained(str(path))
    return hf


def batched_tiles(images: list[Any]) -> dict[str, torch.Tensor]:
    """transformers' LLaVA-NeXT inputs for `ImageInput`s: their tiles padded to one count
    (``pixel_values [n, most, 3, side, side]``, as its processor batches them) and ``image_sizes``."""
    most = max(im.pixel_values.shape[0] for im in images)
    pixels = torch.zeros(len(images), most, *images[0].pixel_values.shape[1:])
    for i, im in enumerate(images):
        pixels[i, : im.pixel_values.shape[0]] = im.pixel_values
    return {"pixel_values": pixels, "image_sizes": torch.tensor([im.grid for im in images])}
