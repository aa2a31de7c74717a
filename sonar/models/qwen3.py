"""Qwen3 (dense): an RMSNorm over each query and key head before the rotation; biases by `attention_bias`."""

from __future__ import annotations

from typing import Any

from sonar.models.decoder import DecoderForCausalLM, DecoderVariant, sliding_windows


class Qwen3ForCausalLM(DecoderForCausalLM):
    architectures = ("Qwen3ForCausalLM",)

    @classmethod
    def make_variant(cls, config: Any) -> DecoderVariant:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderVariant(
            qkv_bias=bias, o_bias=bias, qk_norm=True, mlp_bias=False, sliding_windows=sliding_windows(config)
        )
