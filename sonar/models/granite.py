"""IBM Granite (``GraniteForCausalLM``): Llama's layers with four scalars — the embeddings times
`embedding_multiplier`, each layer's attention and MLP outputs times `residual_multiplier` before
their residual add, `attention_multiplier` as the softmax scale, and the logits divided by
`logits_scaling`."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from sonar.models.decoder import (
    EAGLE,
    DecoderForCausalLM,
    DecoderLayer,
    DecoderVariant,
    sliding_windows,
    unverified,
)
from sonar.models.parallel import SINGLE, TensorParallel


class GraniteLayer(DecoderLayer):
    def __init__(
        self, config: Any, variant: DecoderVariant, layer: int, head_dim: int, parallel: TensorParallel = SINGLE
    ) -> None:
        super().__init__(config, variant, layer, head_dim, parallel)
        self.residual_multiplier = float(config.residual_multiplier)

    def forward(
        self, x: Tensor, residual: Tensor | None, cos: Tensor, sin: Tensor, kv_cache: Tensor
    ) -> tuple[Tensor, Tensor]:
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache) * self.residual_multiplier
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h) * self.residual_multiplier, residual


class GraniteForCausalLM(DecoderForCausalLM):
    architectures = ("GraniteForCausalLM",)
    layer_class = GraniteLayer
    refused = unverified(EAGLE)

    @classmethod
    def make_variant(cls, config: Any) -> DecoderVariant:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderVariant(
            qkv_bias=bias,
            o_bias=bias,
            qk_norm=False,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            sliding_windows=sliding_windows(config),
            attention_scale=float(config.attention_multiplier),
            native_decode=False,
        )

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.model.embed_tokens(input_ids) * self.config.embedding_multiplier

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.parallel.gather_last(self.lm_head(hidden) / self.config.logits_scaling).float()
