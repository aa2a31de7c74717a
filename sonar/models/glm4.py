"""GLM-4-0414 (``Glm4ForCausalLM``): Llama's layers with two more norms — over the attention's
output and over the MLP's, each before its residual add — biases on q/k/v only, and a partial
rotary (half of each head by default) that turns interleaved pairs ``2i, 2i + 1``. The checkpoint
stores gate/up as one ``gate_up_proj``, in the row order of Sonar's fused matrix."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from sonar.models.decoder import (
    EAGLE,
    QUANTIZED,
    DecoderForCausalLM,
    DecoderLayer,
    DecoderVariant,
    RMSNorm,
    sliding_windows,
    unfuse,
    unverified,
)
from sonar.models.parallel import SINGLE, TensorParallel


class Glm4Layer(DecoderLayer):
    def __init__(
        self, config: Any, variant: DecoderVariant, layer: int, head_dim: int, parallel: TensorParallel = SINGLE
    ) -> None:
        super().__init__(config, variant, layer, head_dim, parallel)
        self.post_self_attn_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: Tensor, residual: Tensor | None, cos: Tensor, sin: Tensor, kv_cache: Tensor
    ) -> tuple[Tensor, Tensor]:
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.post_self_attn_layernorm(self.self_attn(h, cos, sin, kv_cache))
        h, residual = self.post_attention_layernorm(h, residual)
        return self.post_mlp_layernorm(self.mlp(h)), residual


class Glm4ForCausalLM(DecoderForCausalLM):
    architectures = ("Glm4ForCausalLM",)
    layer_class = Glm4Layer
    refused = {
        **unverified(EAGLE),
        QUANTIZED: "GLM-4's quantized checkpoints fuse gate_up_proj, which the quantized loader does not split",
    }

    @classmethod
    def make_variant(cls, config: Any) -> DecoderVariant:
        return DecoderVariant(
            qkv_bias=bool(getattr(config, "attention_bias", True)),
            o_bias=False,
            qk_norm=False,
            mlp_bias=False,
            sliding_windows=sliding_windows(config),
            interleaved_rotary=True,
            native_decode=False,
        )

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        inter = self.config.intermediate_size
        return super().load_weights(unfuse(weights, {".gate_up_proj.": [(".gate_proj.", inter), (".up_proj.", inter)]}))
