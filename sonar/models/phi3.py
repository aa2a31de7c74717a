"""Phi-3 and Phi-4 (``Phi3ForCausalLM``): Llama's layers, no biases, LongRoPE scaling and, in
Phi-4-mini, a partial rotary. The checkpoint stores q/k/v as one ``qkv_proj`` and gate/up as one
``gate_up_proj``, in the row order of Sonar's fused matrices.

The layers being Llama's, the native decode loop (`sonar.models.fused`) serves the checkpoints
that rotate whole heads (Phi-3, Phi-4), not those with a partial rotary (Phi-4-mini)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from sonar.models.decoder import (
    EAGLE,
    LORA,
    QUANTIZED,
    DecoderForCausalLM,
    DecoderVariant,
    sliding_windows,
    unfuse,
    unverified,
)


class Phi3ForCausalLM(DecoderForCausalLM):
    architectures = ("Phi3ForCausalLM",)
    refused = {
        **unverified(EAGLE),
        LORA: "Phi-3 adapters target the fused qkv_proj and gate_up_proj, which Sonar's adapter loader does not split",
        QUANTIZED: "Phi-3's quantized checkpoints fuse qkv_proj and gate_up_proj, which the quantized loader "
        "does not split",
    }

    @classmethod
    def make_variant(cls, config: Any) -> DecoderVariant:
        return DecoderVariant(
            qkv_bias=False,
            o_bias=False,
            qk_norm=False,
            mlp_bias=False,
            sliding_windows=sliding_windows(config),
        )

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        q = self.config.num_attention_heads * self.head_dim
        kv = (self.config.num_key_value_heads or self.config.num_attention_heads) * self.head_dim
        inter = self.config.intermediate_size
        fused = {
            ".qkv_proj.": [(".q_proj.", q), (".k_proj.", kv), (".v_proj.", kv)],
            ".gate_up_proj.": [(".gate_proj.", inter), (".up_proj.", inter)],
        }
        return super().load_weights(unfuse(weights, fused))
