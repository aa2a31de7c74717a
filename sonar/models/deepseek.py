"""DeepSeek-V2 and DeepSeek-V3 (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``): multi-head
latent attention (MLA) over a compressed KV cache, and mixture-of-experts layers routed by groups
of experts, as transformers computes them.

Attention (`MlaAttention`). Queries come from ``q_proj`` or, where ``q_lora_rank`` is set, through
a low-rank ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``; each head's query is a
``qk_nope_head_dim`` part and a rotated ``qk_rope_head_dim`` part. Keys and values come from one
*latent* per token: ``kv_a_proj_with_mqa`` gives a ``kv_lora_rank`` vector ``c`` (normed by
``kv_a_layernorm``) and a ``qk_rope_head_dim`` key ``k_pe`` rotated once and shared by all heads;
``kv_b_proj`` expands ``c`` into each head's key part ``W_k[h] c`` and value ``W_v[h] c``
(``v_head_dim``). The rotation is DeepSeek's interleaved one (pairs ``2i, 2i + 1``: V2 always, V3
unless ``rope_interleave`` is false), the softmax scale ``(qk_nope + qk_rope) ** -0.5`` times
``mscale(factor, mscale_all_dim) ** 2`` under yarn rope scaling.

The cache holds the latent, not the heads. Attention runs in *absorbed* form: a query's nope part
is taken into the latent space (``q_nope @ W_k[h]``, ``kv_lora_rank`` wide), so with
``query = [q_nope W_k, q_pe]`` and ``key = [c, k_pe]`` one key "head" serves every query head
(multi-query attention, ``head_dim = kv_lora_rank + qk_rope_head_dim``) and the scores are exactly
``q_nope . W_k c + q_pe . k_pe``. The attention output over the values ``[c, k_pe]`` is cut to its
latent part and taken out through ``W_v[h]``. This runs on Sonar's paged attention unchanged
(reference, native CPU, Triton: they all take grouped-query attention with one KV head) and with
its prefix cache, chunked prefill and block moves, which see an ordinary one-head cache.

What it costs: those kernels keep K and V of equal width in two halves of the cache, so the value
half repeats the key half (the same ``[c, k_pe]``; no kernel reads a second copy differently) and a
token takes ``2 * (kv_lora_rank + qk_rope_head_dim)`` elements per layer (1152 for V2/V3's 512 +
64) where a latent-only cache would take 576 — against ``num_heads * (qk_nope + qk_rope + v_head)``
(40960 for V3's 128 heads) for the expanded keys and values. `model.num_kv_heads` is 1 and
`model.head_dim` the latent width, so the engine sizes the cache by these. Absorbed attention
also makes a long prefill attend at the latent width (576) per head instead of 192/128; a prefill
kernel that expands the latent per block would save that compute, not memory.

Mixture of experts (`DeepseekMoeBlock`): layers from ``first_k_dense_replace`` on are sparse (the
earlier ones a dense MLP of ``intermediate_size``), each with ``n_routed_experts`` experts of
``moe_intermediate_size`` run by the fused operator (`sonar.kernels.moe.fused_experts`), weighted
by the router's weights times ``routed_scaling_factor``, plus ``n_shared_experts`` shared experts
(one MLP of ``n_shared_experts * moe_intermediate_size``) every token goes through. V2 routes by
``topk_method`` ``greedy`` or ``group_limited_greedy`` (`route_group_limited`), V3 by ``noaux_tc``
(`route_noaux_tc`, with ``e_score_correction_bias`` and ``norm_topk_prob``).

Tensor parallelism splits attention by query heads (``q_proj`` / ``q_b_proj`` and ``kv_b_proj``
rows, ``o_proj`` columns, one all-reduce) while the latent projections, their norms and the cache's
one head stay whole on every rank (each rank caches the full latent, as the saving of MLA's cache
is in not having heads to split); the MLPs split as `sonar.models.moe` splits them, expert
parallelism included. Pipeline parallelism splits the layers as for every decoder.

Refused, each naming the field or feature: ``moe_layer_freq`` other than 1, a ``scoring_func``
other than the version's (softmax for V2, sigmoid for V3), V2's ``norm_topk_prob`` (transformers'
V2 ignores it; published V2 checkpoints set it false), other ``topk_method`` values, ``hidden_act``
other than silu; quantized safetensors checkpoints (the published V3 weights are FP8: serve a
bfloat16 conversion), LoRA and EAGLE. GGUF files (llama.cpp's ``deepseek2``, `sonar.models.gguf_arch`)
are served as their quants: the linear layers and the experts quantized (`sonar.models.moe`), the
router and ``kv_b_proj`` (which absorbed attention reads as a tensor) dequantized. V3's multi-token-prediction layers (``num_nextn_predict_layers``,
stored as extra layers after the last) are skipped here: the main model decodes without them, and
speculative ``method: mtp`` reads the first of them from the checkpoint itself
(`sonar.models.deepseek_mtp`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import replace
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sonar.kernels.attention_op import attention
from sonar.kernels.moe import route_group_limited, route_noaux_tc
from sonar.models.decoder import QUANTIZED, DecoderLayer, DecoderVariant, RMSNorm
from sonar.models.errors import ModelLoadError
from sonar.models.moe import GatedMLP, MoeForCausalLM, MoeSpec, SparseMoeBlock
from sonar.models.parallel import SINGLE, WHOLE, PipelineStage, Shard, TensorParallel
from sonar.models.rotary import RotaryEmbedding, apply_partial_rotary, rope_parameters

#: transformers' DeepSeek norms inside attention use their default eps, not ``rms_norm_eps``
_LATENT_NORM_EPS = 1e-6


def softmax_scale(config: Any) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` when the rope is
    scaled and the config has ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = rope_parameters(config)
    m_all = rope.get("mscale_all_dim")
    if rope["rope_type"] != "default" and m_all:
        factor = rope["factor"]
        m = 1.0 if factor <= 1 else 0.1 * m_all * math.log(factor) + 1.0
        scale = scale * m * m
    return scale


class LatentExpansion(nn.Module):
    """``kv_b_proj``'s weight ``[num_heads * (qk_nope + v_head), kv_lora_rank]``, never applied as a
    linear layer: absorbed attention reads each head's key and value halves of it (and, not being
    an ``nn.Linear``, it gets no packed copy from `sonar.kernels.linear.prepack_linears`)."""

    def __init__(self, latent: int, rows: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, latent), requires_grad=False)


class MlaAttention(nn.Module):
    """Multi-head latent attention, in absorbed form over a one-head latent cache (see the module
    docstring). Called as `sonar.models.decoder.Attention` is."""

    num_kv_heads = 1

    def __init__(
        self, config: Any, variant: DecoderVariant, layer: int, head_dim: int, parallel: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, bool(getattr(config, "attention_bias", False))
        self.parallel = parallel
        self.num_heads = parallel.split(config.num_attention_heads, "number of attention heads")
        """This rank's query heads; the latent projections and the cache's one head are whole on
        every rank (each rank caches the full latent: what MLA's cache saves is not split)."""
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.latent = config.v_head_dim, config.kv_lora_rank
        self.head_dim = self.latent + self.rope
        """The width of the cache's one KV head."""
        self.interleaved_rotary = variant.interleaved_rotary
        self.scale = softmax_scale(config)
        qk = self.nope + self.rope
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, self.num_heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.latent + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.latent, _LATENT_NORM_EPS)
        self.kv_b_proj = LatentExpansion(self.latent, self.num_heads * (self.nope + self.v_dim))
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, hidden, bias=bias)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor) -> Tensor:
        n = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(n, self.num_heads, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.latent, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_pe = apply_partial_rotary(q_pe, cos, sin, self.interleaved_rotary)
        k_pe = apply_partial_rotary(k_pe.unsqueeze(1), cos, sin, self.interleaved_rotary)
        w_kv = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.latent)
        w_k, w_v = w_kv[:, : self.nope], w_kv[:, self.nope :]
        # [n, H, nope] x [H, nope, latent] -> [n, H, latent]: the query's nope part in latent space
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_k).transpose(0, 1)
        query = torch.cat((q_latent, q_pe), dim=-1)
        key = torch.cat((latent.unsqueeze(1), k_pe), dim=-1)
        # the value half of the cache holds the same [latent, k_pe] (module docstring: what it costs)
        o = attention(query, key, key, kv_cache, self.scale)
        # [H, n, latent] x [H, latent, v] -> [n, H, v]: out of latent space through each head's W_v
        out = torch.bmm(o[..., : self.latent].transpose(0, 1), w_v.transpose(1, 2)).transpose(0, 1)
        return self.parallel.all_reduce(self.o_proj(out.reshape(n, self.num_heads * self.v_dim)))


class DeepseekRouter(nn.Module):
    """The router's weight ``[E, h]`` (float32 logits, as transformers computes them) and, for
    V3's ``noaux_tc``, the ``e_score_correction_bias`` ``[E]``."""

    def __init__(self, hidden: int, num_experts: int, correction_bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(num_experts), requires_grad=False) if correction_bias else None
        )

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x.float(), self.weight.float())


class DeepseekMoeBlock(SparseMoeBlock):
    """A sparse block with DeepSeek's grouped router, its shared experts (one `GatedMLP`, no gate)
    and ``routed_scaling_factor`` on the routed experts' weights."""

    def __init__(self, config: Any, spec: MoeSpec, method: str, parallel: TensorParallel) -> None:
        super().__init__(config.hidden_size, replace(spec, shared_intermediate=None), parallel)
        self.method = method
        self.num_groups = config.n_group or 1
        self.top_groups = config.topk_group or 1
        self.scaling = float(config.routed_scaling_factor)
        self.gate = DeepseekRouter(config.hidden_size, spec.num_experts, self.method == "noaux_tc")
        if spec.shared_intermediate:
            self.shared_expert = GatedMLP(config.hidden_size, spec.shared_intermediate, parallel)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The experts each row of ``x`` goes to: float32 weights (``routed_scaling_factor``
        applied) and global ids, both ``[n, top_k]``."""
        spec, logits = self.spec, self.gate(x)
        if self.method == "noaux_tc":
            bias = self.gate.e_score_correction_bias
            weights, ids = route_noaux_tc(logits, spec.top_k, self.num_groups, self.top_groups, bias, spec.renormalize)
        elif self.method == "group_limited_greedy":
            weights, ids = route_group_limited(logits, spec.top_k, self.num_groups, self.top_groups)
        else:  # greedy: every expert one group
            weights, ids = route_group_limited(logits, spec.top_k, 1, 1)
        return weights * self.scaling, ids

    def forward(self, x: Tensor) -> Tensor:
        weights, ids = self.route(x)
        out = self.run_experts(x, weights, self.local_ids(ids))
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return self.parallel.all_reduce(out)


class DeepseekDecoderLayer(DecoderLayer):
    """Llama's block with `MlaAttention` (the MLP is the variant's: dense or `DeepseekMoeBlock`)."""

    def __init__(
        self, config: Any, variant: DecoderVariant, layer: int, head_dim: int, parallel: TensorParallel = SINGLE
    ) -> None:
        nn.Module.__init__(self)  # not DecoderLayer's: its `Attention` needs q/k/v heads MLA has not
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MlaAttention(config, variant, layer, head_dim, parallel)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = variant.mlp_factory(config, variant, layer, parallel)


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class _DeepseekForCausalLM(MoeForCausalLM):
    layer_class = DeepseekDecoderLayer
    refused: ClassVar[dict[str, str]] = {
        **MoeForCausalLM.refused,
        QUANTIZED: "Sonar serves DeepSeek's GGUF quants but no quantized safetensors checkpoint (the published V3 "
        "weights are FP8): serve a bfloat16 checkpoint",
    }
    topk_methods: ClassVar[tuple[str, ...]] = ()
    """The ``topk_method`` values served, the first the default where the config has none."""
    scoring_func: ClassVar[str] = ""
    """The router's scores (the hub configs' ``scoring_func``; transformers reads no such field)."""
    interleaved_by_default: ClassVar[bool] = True

    def __init__(self, config: Any, parallel: TensorParallel = SINGLE, stage: PipelineStage = WHOLE) -> None:
        self.check_config(config)
        super().__init__(config, parallel, stage)
        self.head_dim = config.kv_lora_rank + config.qk_rope_head_dim
        """The cache's one KV head: the latent and the shared rotated key (`MlaAttention`)."""
        self.rotary = RotaryEmbedding(
            rope_parameters(config), config.qk_rope_head_dim, getattr(config, "max_position_embeddings", 0)
        )

    @classmethod
    def check_config(cls, config: Any) -> None:
        """A `ModelLoadError` naming the first config field this implementation does not serve."""
        name = cls.__name__
        method = cls.topk_method(config)
        if method not in cls.topk_methods:
            raise ModelLoadError(f"{name}: topk_method {method!r} is not supported (supported: {cls.topk_methods})")
        freq = getattr(config, "moe_layer_freq", 1)
        if freq != 1:
            raise ModelLoadError(f"{name}: moe_layer_freq {freq} is not supported (only 1: every layer sparse)")
        scoring = getattr(config, "scoring_func", None)
        if scoring not in (None, cls.scoring_func):
            raise ModelLoadError(f"{name}: scoring_func {scoring!r} is not supported (only {cls.scoring_func!r})")
        experts, groups = config.n_routed_experts, getattr(config, "n_group", None) or 1
        top_groups = getattr(config, "topk_group", None) or 1
        if method != "greedy" and (experts % groups or not 0 < top_groups <= groups):
            raise ModelLoadError(
                f"{name}: n_group {groups} / topk_group {top_groups} do not fit {experts} routed experts"
            )

    @classmethod
    def topk_method(cls, config: Any) -> str:
        return getattr(config, "topk_method", None) or cls.topk_methods[0]

    @classmethod
    def base_variant(cls, config: Any) -> DecoderVariant:
        return replace(
            MoeForCausalLM.base_variant(config),
            interleaved_rotary=bool(getattr(config, "rope_interleave", cls.interleaved_by_default)),
            native_decode=False,
        )

    @classmethod
    def is_sparse(cls, config: Any, layer: int) -> bool:
        return config.n_routed_experts > 0 and layer >= (config.first_k_dense_replace or 0)

    @classmethod
    def moe_spec(cls, config: Any) -> MoeSpec:
        shared = config.n_shared_experts or 0
        return MoeSpec(
            num_experts=config.n_routed_experts,
            top_k=config.num_experts_per_tok,
            intermediate=config.moe_intermediate_size,
            renormalize=bool(getattr(config, "norm_topk_prob", False)),
            shared_intermediate=shared * config.moe_intermediate_size or None,
        )

    @classmethod
    def make_mlp(cls, config: Any, variant: DecoderVariant, layer: int, parallel: TensorParallel) -> nn.Module:
        if cls.is_sparse(config, layer):
            return DeepseekMoeBlock(config, cls.moe_spec(config), cls.topk_method(config), parallel)
        return super().make_mlp(config, variant, layer, parallel)

    def stacked_params(self) -> dict[str, tuple[str, int, int]]:
        """None in attention (its projections keep their checkpoint names); `_MlpLoader` fuses the MLPs'."""
        return {}

    def checkpoint_name(self, name: str) -> str:
        return name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")

    def checkpoint_shard(self, name: str) -> Shard | None:
        """Tensor parallelism splits attention by query heads (``q_proj`` / ``q_b_proj`` and
        ``kv_b_proj`` rows, ``o_proj`` columns); the latent projections and norms are whole on
        every rank; the MLPs split as `MoeForCausalLM` splits them."""
        tp = self.parallel
        if tp.size == 1 or ".self_attn." not in name:
            return super().checkpoint_shard(name)
        attn = self.own_layers[0].self_attn
        heads, first = attn.num_heads, tp.rank * attn.num_heads
        if name.endswith((".q_proj.weight", ".q_b_proj.weight")):
            width = attn.nope + attn.rope
            return Shard(0, first * width, heads * width)
        if name.endswith(".kv_b_proj.weight"):
            width = attn.nope + attn.v_dim
            return Shard(0, first * width, heads * width)
        if name.endswith(".o_proj.weight"):
            return Shard(1, first * attn.v_dim, heads * attn.v_dim)
        if name.endswith(".o_proj.bias"):  # added once, after the all-reduce
            return Shard(leader_only=True, leader=tp.leader)
        return None

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        layers = self.config.num_hidden_layers
        extra = getattr(self.config, "num_nextn_predict_layers", None) or getattr(self.config, "num_mtp_layers", 0) or 0

        def main_model() -> Iterable[tuple[str, Tensor]]:
            for name, tensor in weights:
                found = _LAYER.match(name)
                if found is not None and layers <= int(found[1]) < layers + extra:
                    continue  # a multi-token-prediction layer: `sonar.models.deepseek_mtp` reads it
                yield name, tensor

        return super().load_weights(main_model())


class DeepseekV2ForCausalLM(_DeepseekForCausalLM):
    architectures: ClassVar[tuple[str, ...]] = ("DeepseekV2ForCausalLM",)
    topk_methods = ("greedy", "group_limited_greedy")
    scoring_func = "softmax"

    @classmethod
    def check_config(cls, config: Any) -> None:
        super().check_config(config)
        if getattr(config, "norm_topk_prob", False):
            raise ModelLoadError(
                "DeepseekV2ForCausalLM: norm_topk_prob true is not supported "
                "(transformers' DeepSeek-V2 does not renormalize; the published V2 checkpoints set it false)"
            )

    @classmethod
    def base_variant(cls, config: Any) -> DecoderVariant:
        return replace(super().base_variant(config), interleaved_rotary=True)  # V2 always rotates pairs


class DeepseekV3ForCausalLM(_DeepseekForCausalLM):
    architectures: ClassVar[tuple[str, ...]] = ("DeepseekV3ForCausalLM",)
    topk_methods = ("noaux_tc",)
    scoring_func = "sigmoid"
