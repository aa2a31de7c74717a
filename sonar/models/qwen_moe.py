"""Qwen2-MoE and Qwen3-MoE: Qwen2's and Qwen3's attention with sparse blocks of ``num_experts``
experts (``moe_intermediate_size`` each) routed top-``num_experts_per_tok``, renormalized when
``norm_topk_prob``. A layer is sparse unless it is in ``mlp_only_layers`` or its number (from 1)
is not a multiple of ``decoder_sparse_step``; the others keep a dense MLP of ``intermediate_size``.
Qwen2-MoE adds a shared expert (``shared_expert_intermediate_size``) to every sparse block, its
output scaled by ``sigmoid(shared_expert_gate(x))``.
"""

from __future__ import annotations

from typing import Any

from sonar.models.decoder import DecoderVariant, sliding_windows
from sonar.models.moe import MoeForCausalLM, MoeSpec


class _QwenMoe(MoeForCausalLM):
    @classmethod
    def is_sparse(cls, config: Any, layer: int) -> bool:
        step = config.decoder_sparse_step
        return (
            layer not in (config.mlp_only_layers or [])
            and config.num_experts > 0
            and step > 0
            and (layer + 1) % step == 0
        )


class Qwen2MoeForCausalLM(_QwenMoe):
    architectures = ("Qwen2MoeForCausalLM",)

    @classmethod
    def base_variant(cls, config: Any) -> DecoderVariant:
        return DecoderVariant(
            qkv_bias=bool(getattr(config, "qkv_bias", True)),
            o_bias=False,
            qk_norm=False,
            mlp_bias=False,
            sliding_windows=sliding_windows(config),
        )

    @classmethod
    def moe_spec(cls, config: Any) -> MoeSpec:
        return MoeSpec(
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            intermediate=config.moe_intermediate_size,
            renormalize=bool(config.norm_topk_prob),
            shared_intermediate=config.shared_expert_intermediate_size,
        )


class Qwen3MoeForCausalLM(_QwenMoe):
    architectures = ("Qwen3MoeForCausalLM",)

    @classmethod
    def base_variant(cls, config: Any) -> DecoderVariant:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderVariant(
            qkv_bias=bias, o_bias=bias, qk_norm=True, mlp_bias=False, sliding_windows=sliding_windows(config)
        )

    @classmethod
    def moe_spec(cls, config: Any) -> MoeSpec:
        return MoeSpec(
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            intermediate=config.moe_intermediate_size,
            renormalize=bool(config.norm_topk_prob),
        )
