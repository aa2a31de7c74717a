"""A tiny random-weight Gemma 3 vision-language checkpoint, built and saved by transformers at test
time: a 2-layer SigLIP tower over 32x32 images in 4x4 patches (64 patches, pooled 2x2 to 16 image
rows), a 3-layer Gemma 3 decoder (two sliding layers of window 8 — narrower than an image's 16
tokens — then a global one), a word-level tokenizer (token ``i`` is ``w<i>``) with
``<start_of_image>``, ``<image_soft_token>``, ``<end_of_image>`` added after the words, and a
Gemma 3 image processor config of that size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.engine.conftest import save_word_tokenizer, spread_weights

WORDS = 390
BOI, IMAGE_TOKEN, EOI = WORDS, WORDS + 1, WORDS + 2
IMAGE_SIZE, PATCH, TOKENS_PER_IMAGE = 32, 4, 16
SLIDING_WINDOW = 8

CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'user' %}w1 {{ m.content }} w2{% else %} {{ m.content }} w3"
    "{% endif %}{% endfor %}{% if add_generation_prompt %} w4{% endif %}"
)


def gemma3_config() -> Any:
    from transformers import Gemma3Config

    return Gemma3Config(
        text_config=dict(
            vocab_size=WORDS + 3,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=512,
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            },
            query_pre_attn_scalar=16,
            rms_norm_eps=1e-6,
            pad_token_id=0,
            bos_token_id=None,
            eos_token_id=None,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=IMAGE_SIZE,
            patch_size=PATCH,
            vision_use_head=False,
        ),
        mm_tokens_per_image=TOKENS_PER_IMAGE,
        boi_token_index=BOI,
        eoi_token_index=EOI,
        image_token_index=IMAGE_TOKEN,
        architectures=["Gemma3ForConditionalGeneration"],
    )


def save_tiny_gemma3(path: Path, seed: int = 0) -> Any:
    """Save the tiny Gemma 3 checkpoint with its tokenizer and image processor under `path`;
    return the transformers model (float32, eval mode)."""
    from transformers import Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    hf = Gemma3ForConditionalGeneration(gemma3_config()).eval()
    spread_weights(hf)
    with torch.no_grad():  # SigLIP's LayerNorms: "layer_norm1.weight", "post_layernorm.weight"
        for name, param in hf.named_parameters():
            if ("layer_norm" in name or "layernorm" in name) and name.endswith("weight") and "vision" in name:
                param.copy_(1 + 0.2 * torch.randn_like(param))
    hf.save_pretrained(str(path))
    save_word_tokenizer(path, WORDS)
    tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_image>", "<image_soft_token>", "<end_of_image>"]})
    assert tok.convert_tokens_to_ids("<image_soft_token>") == IMAGE_TOKEN
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(path))
    Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(str(path))
    return hf
