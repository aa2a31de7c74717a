"""A tiny random-weight LLaVA-NeXT checkpoint, built and saved by transformers at test time: the
tiny LLaVA's CLIP tower (16x16 tiles in 4x4 patches) and Llama, any-resolution pinpoints of one
to two tiles a side, the same word-level tokenizer and chat template, and a LLaVA-NeXT image
processor config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.engine.conftest import save_word_tokenizer, spread_weights
from tests.multimodal.tiny_llava import CHAT_TEMPLATE, IMAGE_SIZE, IMAGE_TOKEN_ID, WORDS, llava_config

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
    from transformers import LlavaNextForConditionalGeneration, LlavaNextImageProcessorPil, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    hf = LlavaNextForConditionalGeneration(llava_next_config()).eval()
    spread_weights(hf)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "layer_norm" in name and name.endswith("weight") or name.endswith("layrnorm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
    hf.save_pretrained(str(path))
    save_word_tokenizer(path, WORDS)
    tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    assert tok.convert_tokens_to_ids("<image>") == IMAGE_TOKEN_ID
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(path))
    LlavaNextImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        image_grid_pinpoints=PINPOINTS,
    ).save_pretrained(str(path))
    return hf
