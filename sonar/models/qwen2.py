"""Qwen2 / Qwen2.5: Llama's layers with biases on the q/k/v projections (none on o_proj)."""

from __future__ import annotations

from typing import Any

from sonar.models.decoder import DecoderForCausalLM, DecoderVariant, sliding_windows


class Qwen2ForCausalLM(DecoderForCausalLM):
    architectures = ("Qwen2ForCausalLM",)

    @classmethod
    def make_variant(cls, config: Any) -> DecoderVariant:
        return DecoderVariant(
            qkv_bias=True, o_bias=False, qk_norm=False, mlp_bias=False, sliding_windows=sliding_windows(config)
        )
