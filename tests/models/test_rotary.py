"""`sonar.models.rotary` against transformers: each rope type's inverse frequencies and attention
factor (`ROPE_INIT_FUNCTIONS`), the cos/sin of the positions Sonar serves (the families' own
rotary modules), and the partial and interleaved rotations (their `apply_rotary_pos_emb`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sonar.models.errors import ModelLoadError
from sonar.models.rotary import (
    LONG_ROPE,
    RotaryEmbedding,
    apply_partial_rotary,
    inv_freq_and_scale,
    longrope_inv_freq,
    longrope_switch,
    rope_parameters,
)
from tests.models.conftest import PHI3_LONGROPE

COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _configs() -> dict[str, Any]:
    from transformers import Glm4Config, LlamaConfig, Phi3Config

    def llama(**rope: Any) -> Any:
        return LlamaConfig(**COMMON, rope_parameters={"rope_theta": 5000.0, **rope})

    return {
        "default": llama(rope_type="default"),
        "linear": llama(rope_type="linear", factor=3.0),
        "dynamic": llama(rope_type="dynamic", factor=2.5),
        "llama3": llama(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
        ),
        "yarn": llama(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
        "longrope": Phi3Config(
            **COMMON, partial_rotary_factor=0.75, original_max_position_embeddings=64, rope_scaling=PHI3_LONGROPE
        ),
        "partial": Glm4Config(**COMMON, head_dim=16),
    }


CONFIGS = _configs()


def _hf_rotary(config: Any) -> Any:
    """The family's own rotary module (it applies transformers' per-call frequency updates)."""
    from transformers.models.glm4.modeling_glm4 import Glm4RotaryEmbedding
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    cls = {"phi3": Phi3RotaryEmbedding, "glm4": Glm4RotaryEmbedding}.get(config.model_type, LlamaRotaryEmbedding)
    return cls(config)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_inv_freq_and_attention_factor_equal_transformers(name: str) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = CONFIGS[name]
    params = rope_parameters(config)
    ours, scale = inv_freq_and_scale(params, 16, config.max_position_embeddings)
    rope_type = params["rope_type"]
    if rope_type == "default":
        ref, ref_scale = _hf_rotary(config).compute_default_rope_parameters(config)
    else:
        ref, ref_scale = ROPE_INIT_FUNCTIONS[rope_type](config, None)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert torch.equal(ours, ref)
    assert scale == pytest.approx(ref_scale, rel=1e-12)


def test_longrope_both_factor_sets_equal_transformers() -> None:
    """The long set is transformers' above the original context, the short one below; the
    attention factor comes from max_position_embeddings / original (4 here) for both."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = CONFIGS["longrope"]
    params = rope_parameters(config)
    for long, seq_len in ((False, 64), (True, 65)):
        ours, scale = longrope_inv_freq(params, 16, 256, long=long)
        ref, ref_scale = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=seq_len)
        assert torch.equal(ours, ref), long
        assert scale == pytest.approx(ref_scale, rel=1e-12) and scale > 1
    short, _ = longrope_inv_freq(params, 16, 256, long=False)
    assert not torch.equal(short, longrope_inv_freq(params, 16, 256, long=True)[0])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cos_sin_equal_transformers_at_every_short_position(name: str) -> None:
    """Every position of a sequence transformers computes with one set of frequencies (LongRoPE:
    within the original context, the short factors)."""
    config = CONFIGS[name]
    params = rope_parameters(config)
    served = longrope_switch(params, config.max_position_embeddings) or config.max_position_embeddings
    positions = torch.arange(served)
    cos, sin = RotaryEmbedding(params, 16, config.max_position_embeddings).cos_sin(positions, torch.float32)
    hf = _hf_rotary(config)
    # transformers picks its frequencies per call from the largest position: one call per position
    for p in (0, 1, served // 2, served - 1):
        ref_cos, ref_sin = hf(torch.zeros(1), positions[None, p : p + 1])
        assert torch.equal(cos[p], ref_cos[0, 0]) and torch.equal(sin[p], ref_sin[0, 0]), p
    ref_cos, ref_sin = hf(torch.zeros(1), positions[None])  # and all served positions in one call
    assert torch.equal(cos, ref_cos[0]) and torch.equal(sin, ref_sin[0])


def test_longrope_cos_sin_from_long_rope_positions_equal_transformers_long_factors() -> None:
    """A row at ``LONG_ROPE + p`` turns position p with the long factors: a whole 256-token
    sequence (transformers' long set, the largest position past the original 64) and, in the same
    call, rows of a short sequence beside it."""
    config = CONFIGS["longrope"]
    rotary = RotaryEmbedding(rope_parameters(config), 16, 256)
    positions = torch.arange(256)
    cos, sin = rotary.cos_sin(LONG_ROPE + positions, torch.float32)
    ref_cos, ref_sin = _hf_rotary(config)(torch.zeros(1), positions[None])
    assert torch.equal(cos, ref_cos[0]) and torch.equal(sin, ref_sin[0])
    short_cos, _ = rotary.cos_sin(positions[:64], torch.float32)
    mixed_cos, mixed_sin = rotary.cos_sin(torch.cat((positions[:64], LONG_ROPE + positions[64:])), torch.float32)
    assert torch.equal(mixed_cos[:64], short_cos) and torch.equal(mixed_cos[64:], cos[64:])
    assert torch.equal(mixed_sin[64:], sin[64:])
    assert not torch.equal(short_cos[1:], cos[1:64])


def test_longrope_switch() -> None:
    """LongRoPE switches factor sets past the original context (64 of 256 here); nothing else does
    (dynamic scales nothing below max_position_embeddings)."""
    assert longrope_switch(rope_parameters(CONFIGS["longrope"]), 256) == 64
    assert longrope_switch(rope_parameters(CONFIGS["longrope"]), 64) is None
    for name in ("dynamic", "yarn", "default"):
        assert longrope_switch(rope_parameters(CONFIGS[name]), 256) is None


@pytest.mark.parametrize("family", ["phi3", "glm4"])
def test_partial_rotary_equals_transformers(family: str) -> None:
    """Phi-3's partial rotary (halves of the first 12 of 16 dims) and GLM-4's (interleaved pairs
    of the first 8)."""
    from transformers.models.glm4 import modeling_glm4
    from transformers.models.phi3 import modeling_phi3

    config = CONFIGS["longrope" if family == "phi3" else "partial"]
    module = modeling_phi3 if family == "phi3" else modeling_glm4
    params = rope_parameters(config)
    positions = torch.tensor([0, 3, 17, 40, 63])
    cos, sin = RotaryEmbedding(params, 16, 256).cos_sin(positions, torch.float32)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 4, 16, generator=gen), torch.randn(5, 2, 16, generator=gen)
    # transformers' layout: [batch, heads, tokens, head_dim]; cos/sin [batch, tokens, rotary_dim]
    ref_q, ref_k = module.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    interleaved = family == "glm4"
    torch.testing.assert_close(apply_partial_rotary(q, cos, sin, interleaved), ref_q[0].transpose(0, 1))
    torch.testing.assert_close(apply_partial_rotary(k, cos, sin, interleaved), ref_k[0].transpose(0, 1))
    rot = cos.shape[-1]
    assert rot == (12 if family == "phi3" else 8)
    assert torch.equal(apply_partial_rotary(q, cos, sin, interleaved)[..., rot:], q[..., rot:])


def test_unknown_rope_type_names_the_supported_ones() -> None:
    with pytest.raises(ModelLoadError, match=r"rope_type 'mrope' is not supported \(supported: default, linear"):
        inv_freq_and_scale({"rope_type": "mrope", "rope_theta": 10000.0}, 16, 256)


def test_longrope_factors_must_cover_the_rotary() -> None:
    params = {**rope_parameters(CONFIGS["longrope"]), "partial_rotary_factor": 1.0}
    with pytest.raises(ModelLoadError, match="short_factor has 6 values, the rotary needs 8"):
        inv_freq_and_scale(params, 16, 256)


def test_interleaved_mrope_equals_qwen3_vl() -> None:
    """Qwen3-VL's sections (24, 20, 20) over 128-wide heads: each frequency turns with the position
    transformers' interleaving gives it, at positions whose three rows all differ."""
    from transformers import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    config = Qwen3VLTextConfig(
        hidden_size=256,
        num_attention_heads=2,
        head_dim=128,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20]},
    )
    rope = RotaryEmbedding({**rope_parameters(config), "mrope_interleaved": True}, 128, config.max_position_embeddings)
    positions = torch.randint(0, 4000, (3, 9), generator=torch.Generator().manual_seed(0))
    cos, sin = rope.cos_sin(positions, torch.float32)
    ref_cos, ref_sin = Qwen3VLTextRotaryEmbedding(config)(torch.zeros(1), positions[:, None])
    torch.testing.assert_close(cos, ref_cos[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(sin, ref_sin[0], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(
        cos, RotaryEmbedding(rope_parameters(config), 128, 4000).cos_sin(positions, torch.float32)[0]
    )
