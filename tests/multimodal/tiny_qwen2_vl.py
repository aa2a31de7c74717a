"""A tiny random-weight Qwen2.5-VL (or Qwen2-VL) checkpoint, built and saved by transformers at
test time: a 3-block vision tower over 4x4 patches (merged 2x2; Qwen2.5-VL: windows of 2x2 merged
blocks, block 1 full attention), a two-layer Qwen2 decoder with M-RoPE sections (2, 3, 3), a word-level tokenizer
(token ``i`` is ``w<i>``) with ``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>`` added
after the words, and a Qwen2-VL image processor config of those patch sizes (images of 256 to
4096 pixels)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.engine.conftest import save_word_tokenizer, spread_weights

WORDS = 390
VISION_START, IMAGE_PAD, VISION_END = WORDS, WORDS + 1, WORDS + 2
PATCH, MERGE, TEMPORAL = 4, 2, 2
MIN_PIXELS, MAX_PIXELS = 16 * 16, 64 * 64

CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'user' %}w1 {{ m.content }} w2{% else %} {{ m.content }} w3"
    "{% endif %}{% endfor %}{% if add_generation_prompt %} w4{% endif %}"
)


def qwen3_vl_config(moe: bool = False) -> Any:
    """Qwen3-VL: 24-wide heads (not hidden / heads) whose 12 frequencies interleave M-RoPE sections
    (4, 4, 4), a learned 4x4 position table resampled to each grid, DeepStack after blocks 0 and 2.
    `moe`: Qwen3-VL MoE, sparse blocks of 4 experts (48 wide: neither expert tensor square, so
    its layout is known from its shape) routed top-2 in layers 0 and 2, a dense MLP in layer 1."""
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, mlp_only_layers=[1])
    return (Qwen3VLMoeConfig if moe else Qwen3VLConfig)(
        text_config=dict(
            **(experts if moe else {}),
            vocab_size=WORDS + 3,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            max_position_embeddings=512,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [4, 4, 4],
                "mrope_interleaved": True,
            },
            rms_norm_eps=1e-6,
            pad_token_id=0,
        ),
        vision_config=dict(
            depth=3,
            hidden_size=32,
            intermediate_size=64,
            num_heads=4,
            out_hidden_size=64,
            num_position_embeddings=16,
            deepstack_visual_indexes=[0, 2],
            hidden_act="gelu_pytorch_tanh",
            patch_size=PATCH,
            spatial_merge_size=MERGE,
            temporal_patch_size=TEMPORAL,
        ),
        image_token_id=IMAGE_PAD,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        video_token_id=0,
        architectures=["Qwen3VLMoeForConditionalGeneration" if moe else "Qwen3VLForConditionalGeneration"],
    )


def qwen2_5_vl_config(family: str = "qwen2_5_vl") -> Any:
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    if family in ("qwen3_vl", "qwen3_vl_moe"):
        return qwen3_vl_config(moe=family == "qwen3_vl_moe")
    if family == "qwen2_vl":
        config, architecture = Qwen2VLConfig, "Qwen2VLForConditionalGeneration"
        vision = dict(depth=3, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=4, hidden_act="quick_gelu")
    else:
        config, architecture = Qwen2_5_VLConfig, "Qwen2_5_VLForConditionalGeneration"
        vision = dict(
            depth=3,
            hidden_size=32,
            intermediate_size=64,
            num_heads=4,
            out_hidden_size=64,
            window_size=16,  # 2x2 merged blocks of 2x2 patches of 4 px
            fullatt_block_indexes=[1],
        )
    return config(
        text_config=dict(
            vocab_size=WORDS + 3,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
            rope_theta=10000.0,
            rms_norm_eps=1e-6,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=0,
        ),
        vision_config=dict(**vision, patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL),
        image_token_id=IMAGE_PAD,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        video_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
        architectures=[architecture],
    )


def save_tiny_qwen2_5_vl(path: Path, seed: int = 0, family: str = "qwen2_5_vl") -> Any:
    """Save a tiny Qwen2.5-VL (`family` ``qwen2_vl``: Qwen2-VL; ``qwen3_vl``: Qwen3-VL; ``qwen3_vl_moe``:
    Qwen3-VL MoE) checkpoint with its tokenizer and image processor under `path`; return the
    transformers model (float32, eval mode)."""
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeForConditionalGeneration,
    )

    torch.manual_seed(seed)
    model = {
        "qwen2_vl": Qwen2VLForConditionalGeneration,
        "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
        "qwen3_vl": Qwen3VLForConditionalGeneration,
        "qwen3_vl_moe": Qwen3VLMoeForConditionalGeneration,
    }[family]
    hf = model(qwen2_5_vl_config(family)).eval()
    spread_weights(hf)
    with torch.no_grad():  # the vision norms are "norm1"/"norm2"/"ln_q", not "...norm.weight"
        for name, param in hf.named_parameters():
            if name.endswith(("norm1.weight", "norm2.weight", "ln_q.weight")):
                param.copy_(1 + 0.2 * torch.randn_like(param))
    hf.save_pretrained(str(path))
    save_word_tokenizer(path, WORDS)
    tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    tok.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]})
    assert tok.convert_tokens_to_ids("<|image_pad|>") == IMAGE_PAD
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(path))
    Qwen2VLImageProcessorPil(
        patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS
    ).save_pretrained(str(path))
    return hf
