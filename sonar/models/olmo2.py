"""OLMo 2 (``Olmo2ForCausalLM``): norms after the attention and after the MLP, over their outputs
before each residual add, instead of before them; an RMSNorm over the whole projected query and
key (all heads at once, not per head: with tensor parallelism the ranks sum their heads' squares);
biases by `attention_bias`.

OLMo 2's norms multiply by their weight in float32 and round once (Llama's round, then multiply):
`Olmo2RMSNorm` keeps that order, so bfloat16 runs round as transformers does.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from sonar.kernels.attention_op import attention
from sonar.models.decoder import (
    EAGLE,
    MLP,
    Attention,
    DecoderForCausalLM,
    DecoderVariant,
    unverified,
)
from sonar.models.parallel import SINGLE, WHOLE, PipelineStage, Shard, TensorParallel


class Olmo2RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """The norm of ``x``; with ``residual``, of ``x + residual``, returned beside it."""
        if residual is not None:
            x = x + residual
        h = x.float()
        out = self.scaled(x, h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps))
        return out if residual is None else (out, x)

    def scaled(self, x: Tensor, normed: Tensor) -> Tensor:
        return (self.weight * normed).to(x.dtype)


class ShardedQKNorm(Olmo2RMSNorm):
    """OLMo 2's norm over a whole projected query or key of which this rank holds a shard (its
    heads): the squares are summed over the group, each head counted once (KV heads that several
    ranks replicate appear `replicas` times in the sum)."""

    def __init__(self, size: int, eps: float, total: int, replicas: int, parallel: TensorParallel) -> None:
        super().__init__(size, eps)
        self.total = total
        self.replicas = replicas
        self.parallel = parallel

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        h = x.float()
        squares = self.parallel.all_reduce(h.pow(2).sum(-1, keepdim=True)) / self.replicas
        return self.scaled(x, h * torch.rsqrt(squares / self.total + self.eps))


class Olmo2Attention(Attention):
    def __init__(
        self, config: Any, variant: DecoderVariant, layer: int, head_dim: int, parallel: TensorParallel = SINGLE
    ) -> None:
        super().__init__(config, variant, layer, head_dim, parallel)
        eps = config.rms_norm_eps
        if parallel.size == 1:
            self.q_norm = Olmo2RMSNorm(self.q_size, eps)
            self.k_norm = Olmo2RMSNorm(self.kv_size, eps)
        else:
            kv_heads = config.num_key_value_heads or config.num_attention_heads
            self.q_norm = ShardedQKNorm(self.q_size, eps, config.num_attention_heads * head_dim, 1, parallel)
            replicas = max(parallel.size // kv_heads, 1)
            self.k_norm = ShardedQKNorm(self.kv_size, eps, kv_heads * head_dim, replicas, parallel)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor) -> Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.rotate(self.q_norm(q).view(n, self.num_heads, self.head_dim), cos, sin)
        k = self.rotate(self.k_norm(k).view(n, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        o = attention(q, k, v, kv_cache, self.scale, self.sliding_window)
        return self.parallel.all_reduce(self.o_proj(o.reshape(n, self.q_size)))


class Olmo2Layer(nn.Module):
    def __init__(
        self, config: Any, variant: DecoderVariant, layer: int, head_dim: int, parallel: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(config, variant, layer, head_dim, parallel)
        self.post_attention_layernorm = Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, variant, parallel)
        self.post_feedforward_layernorm = Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: Tensor, residual: Tensor | None, cos: Tensor, sin: Tensor, kv_cache: Tensor
    ) -> tuple[Tensor, Tensor]:
        """As `sonar.models.decoder.DecoderLayer.forward`: the MLP's normed output, and the residual
        stream it is to be added to."""
        stream = x if residual is None else x + residual
        stream = stream + self.post_attention_layernorm(self.self_attn(stream, cos, sin, kv_cache))
        return self.post_feedforward_layernorm(self.mlp(stream)), stream


class Olmo2ForCausalLM(DecoderForCausalLM):
    architectures = ("Olmo2ForCausalLM",)
    layer_class = Olmo2Layer
    refused = unverified(EAGLE)

    def __init__(self, config: Any, parallel: TensorParallel = SINGLE, stage: PipelineStage = WHOLE) -> None:
        super().__init__(config, parallel, stage)
        self.model.norm = Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps)

    @classmethod
    def make_variant(cls, config: Any) -> DecoderVariant:
        return replace(super().make_variant(config), native_decode=False)

    def checkpoint_shard(self, name: str) -> Shard | None:
        """The q/k norms' weights split as the heads they scale."""
        tp, attn = self.parallel, self.own_layers[0].self_attn
        if tp.size > 1 and ".q_norm." in name:
            return Shard(0, tp.rank * attn.q_size, attn.q_size)
        if tp.size > 1 and ".k_norm." in name:
            return Shard(0, attn.first_kv_head * self.head_dim, attn.kv_size)
        return super().checkpoint_shard(name)
