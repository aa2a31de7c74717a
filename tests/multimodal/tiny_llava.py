"""A tiny random-weight LLaVA checkpoint, built and saved by transformers at test time: a CLIP
tower of 16x16 images in 4x4 patches (16 patches), a two-layer Llama, a word-level tokenizer
(token ``i`` is ``w<i>``) with ``<image>`` added as the last token, a CLIP image processor config
and a chat template that puts the user's text after ``USER:``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.engine.conftest import save_word_tokenizer, spread_weights

WORDS = 391
IMAGE_TOKEN_ID = WORDS  # "<image>", added after the words
IMAGE_SIZE = 16
PATCH = 4

CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'user' %}w1 {{ m.content }} w2{% else %} {{ m.content }} w3"
    "{% endif %}{% endfor %}{% if add_generation_prompt %} w4{% endif %}"
)


def llava_config(strategy: str = "default", feature_layer: int | list[int] = -2) -> Any:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
        projection_dim=32,
    )
    text = LlamaConfig(
        vocab_size=WORDS + 1,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    return LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=IMAGE_TOKEN_ID,
        vision_feature_select_strategy=strategy,
        vision_feature_layer=feature_layer,
        architectures=["LlavaForConditionalGeneration"],
    )


def save_tiny_llava(path: Path, seed: int = 0, **config: Any) -> Any:
    """Save a tiny LLaVA checkpoint with its tokenizer and image processor under `path`; return
    the transformers model (float32, eval mode)."""
    from transformers import CLIPImageProcessorPil, LlavaForConditionalGeneration

    torch.manual_seed(seed)
    hf = LlavaForConditionalGeneration(llava_config(**config)).eval()
    save_weights_and_tokenizer(path, hf)
    CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    ).save_pretrained(str(path))
    return hf


def save_weights_and_tokenizer(path: Path, hf: Any) -> None:
    """Spread `hf`'s random weights (from torch's current seed) and save them with the word-level
    tokenizer, ``<image>`` and the chat template."""
    from transformers import PreTrainedTokenizerFast

    spread_weights(hf)
    with torch.no_grad():  # CLIP's LayerNorms end in "layer_norm1.weight" etc., not "norm.weight"
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


def random_image(seed: int, size: tuple[int, int] = (20, 24)) -> Any:
    """A random RGB picture (not square: the processor resizes and crops it)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")
