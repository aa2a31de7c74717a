"""Gemma (v1), Gemma 2 and Gemma 3 (text): Google's decoders, as transformers computes them.

What sets them apart from `sonar.models.decoder`'s Llama-shaped layers:

* RMSNorm multiplies by ``1 + weight``, in float32, before the cast back (`GemmaRMSNorm`);
* the embeddings are scaled by ``sqrt(hidden_size)`` rounded to the model's dtype;
* the MLP gates with GELU's tanh approximation (``gelu_pytorch_tanh``);
* Gemma 2 and 3 wrap each block in two norms ("sandwich": ``post_attention_layernorm`` on the
  attention's output before the residual add, ``pre_feedforward_layernorm`` /
  ``post_feedforward_layernorm`` around the MLP), scale the scores by ``query_pre_attn_scalar**-0.5``
  instead of ``head_dim**-0.5``, and alternate sliding-window and global layers (`layer_types`);
* Gemma 2 soft-caps the attention scores (``attn_logit_softcapping``, through every attention path:
  `sonar.kernels.ops.paged_attention`); Gemma 2 and 3 the final logits (``final_logit_softcapping``).
  transformers' Gemma 3 ignores ``attn_logit_softcapping``: a Gemma 3 config that sets it is refused;
* Gemma 3 norms each query and key head (``q_norm`` / ``k_norm``) before the rotation and rotates
  sliding layers with their own rope base (``rope_parameters["sliding_attention"]``, or the older
  configs' ``rope_local_base_freq``), global ones with the (possibly scaled) global rope.

The models keep `DecoderForCausalLM`'s contract for the runner (`forward`, `forward_tensors`,
`compute_logits`) and its checkpoint loading (the same fused ``qkv_proj`` / ``gate_up_proj``), with
layers of their own. What Sonar does not implement for them is refused at load with the feature
named: tensor and pipeline parallelism and bidirectional attention here; quantization, LoRA and
EAGLE heads where they attach (`refused`, read by `require_support` in `sonar.models.loader`,
`sonar.lora.slots`, `sonar.models.eagle`), and the native decode layer loop (`sonar.models.fused`)
leaves them alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from sonar.kernels import ops
from sonar.kernels.attention_op import attention
from sonar.models.decoder import (
    EAGLE,
    LORA,
    PIPELINE_PARALLEL,
    QUANTIZED,
    TENSOR_PARALLEL,
    DecoderForCausalLM,
)
from sonar.models.errors import ModelLoadError
from sonar.models.fused import FusedDecode
from sonar.models.parallel import SINGLE, WHOLE, PipelineStage, TensorParallel
from sonar.models.rotary import RotaryEmbedding, rope_parameters

SLIDING, FULL = "sliding_attention", "full_attention"
GELU_TANH = "gelu_pytorch_tanh"


class GemmaRMSNorm(nn.Module):
    """``x / rms(x) * (1 + weight)``, all in float32, cast back to ``x``'s dtype once at the end."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """The norm of ``x``; with ``residual``, of ``x + residual`` (added in ``x``'s dtype, as
        transformers adds the residual stream), returned beside the norm."""
        if residual is not None:
            x = residual + x
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (h * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, x)


class GemmaAttention(nn.Module):
    """Self-attention with Gemma's scale, optional per-head q/k norm and score soft-capping.

    Keeps `sonar.models.decoder.Attention`'s names (``qkv_proj``, ``q_size``, ``kv_size``) so the
    checkpoint loading of `DecoderForCausalLM` fills it."""

    def __init__(self, config: Any, spec: GemmaSpec, head_dim: int, sliding_window: int | None) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or config.num_attention_heads
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.scale = spec.scale
        self.softcap = spec.attn_softcap
        self.sliding_window = sliding_window
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bias)
        self.qk_norm = spec.qk_norm
        if spec.qk_norm:
            self.q_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor, attend: Callable[..., Tensor] | None = None
    ) -> Tensor:
        """`attend` replaces the causal `attention` (same arguments), for a step whose image tokens
        attend to each other (`sonar.models.gemma3_vl.ImageBlocks.attend`)."""
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = ops.apply_rotary(q, cos, sin), ops.apply_rotary(k, cos, sin)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        o = (attend or attention)(q, k, v, kv_cache, self.scale, self.sliding_window, self.softcap)
        return self.o_proj(o.reshape(n, self.q_size))


class GemmaMLP(nn.Module):
    """The GELU(tanh)-gated MLP."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate, bias=False)
        self.down_proj = nn.Linear(self.intermediate, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(ops.gelu_tanh_and_mul(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: Any, spec: GemmaSpec, layer: int, head_dim: int) -> None:
        super().__init__()
        self.kind = spec.layer_kinds[layer]
        window = config.sliding_window if self.kind == SLIDING else None
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.self_attn = GemmaAttention(config, spec, head_dim, window)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.sandwich = spec.sandwich_norms
        if spec.sandwich_norms:
            self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
            self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.mlp = GemmaMLP(config)

    def forward(
        self,
        x: Tensor,
        residual: Tensor | None,
        cos: Tensor,
        sin: Tensor,
        kv_cache: Tensor,
        attend: Callable[..., Tensor] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """As `sonar.models.decoder.DecoderLayer.forward`: returns this layer's output and the
        residual stream it is still to be added to (inside the next norm); `attend` as
        `GemmaAttention.forward`'s."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, attend)
        if not self.sandwich:
            h, residual = self.post_attention_layernorm(h, residual)
            return self.mlp(h), residual
        h, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(h), residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class GemmaModel(nn.Module):
    """The checkpoint's ``model.*``: embeddings, layers, final norm."""

    def __init__(self, config: Any, spec: GemmaSpec, head_dim: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, spec, i, head_dim) for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)


class GemmaSpec:
    """What a config asks of the layers, read and checked once (`ModelLoadError` naming what Sonar
    does not implement)."""

    def __init__(self, config: Any, head_dim: int, generation: int) -> None:
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None) or GELU_TANH
        if act != GELU_TANH:
            raise ModelLoadError(f"Gemma hidden_activation {act!r} is not supported (only {GELU_TANH})")
        if getattr(config, "use_bidirectional_attention", False):
            raise ModelLoadError("Gemma use_bidirectional_attention (an encoder's mask) is not supported")
        self.sandwich_norms = generation >= 2
        self.qk_norm = generation >= 3
        scalar = getattr(config, "query_pre_attn_scalar", None) if generation >= 2 else None
        self.scale = float(scalar or head_dim) ** -0.5
        self.attn_softcap = _cap(getattr(config, "attn_logit_softcapping", None))
        if generation == 3 and self.attn_softcap is not None:
            # transformers' Gemma 3 reads the field and never applies it: neither guess is safe
            raise ModelLoadError(
                "Gemma 3 attn_logit_softcapping is set, which transformers' Gemma 3 does not apply; "
                "Sonar does not serve it (Gemma 3 checkpoints leave it null)"
            )
        self.final_softcap = _cap(getattr(config, "final_logit_softcapping", None))
        self.layer_kinds = _layer_kinds(config, generation)


def _cap(value: Any) -> float | None:
    """A soft-capping value; None or 0 turn it off."""
    return float(value) if value else None


#: transformers' default `sliding_window_pattern` (every n-th layer global) per Gemma generation
DEFAULT_PATTERN = {2: 2, 3: 6}


def _layer_kinds(config: Any, generation: int) -> tuple[str, ...]:
    """Each layer's attention kind: `layer_types` where the config has them, else every
    `sliding_window_pattern`-th layer global and the others sliding (Gemma v1: all global)."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types is None and generation >= 2:
        pattern = getattr(config, "sliding_window_pattern", None) or DEFAULT_PATTERN[generation]
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    kinds = tuple(types or (FULL,) * n)
    unknown = sorted(set(kinds) - {SLIDING, FULL})
    if unknown or len(kinds) != n:
        raise ModelLoadError(f"Gemma layer_types {list(kinds)} are not {n} of {SLIDING!r} / {FULL!r}")
    if SLIDING in kinds and not getattr(config, "sliding_window", None):
        raise ModelLoadError("Gemma layer_types name sliding_attention layers but the config has no sliding_window")
    return kinds


def rope_by_kind(config: Any, kinds: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """The rope parameters of each attention kind: per kind where `rope_parameters` is keyed by
    them (transformers 5's Gemma 3), else the config's one rope for global layers and, for sliding
    ones, the same with ``rope_local_base_freq`` as the base where the config has one."""
    nested = getattr(config, "rope_parameters", None)
    out = {}
    for kind in dict.fromkeys(kinds):  # in layer order: the first layer's kind first
        if isinstance(nested, dict) and kind in nested:
            params = dict(nested[kind] or {})
            params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
            params.setdefault("rope_theta", 10000.0)
        else:
            params = rope_parameters(config)
            local = getattr(config, "rope_local_base_freq", None)
            if kind == SLIDING and local is not None:
                params = {"rope_type": "default", "rope_theta": local}
        out[kind] = params
    return out


class LayerRotary:
    """One `RotaryEmbedding` per attention kind; `tables` gives a step's cos/sin for each."""

    def __init__(self, params: dict[str, dict[str, Any]], head_dim: int, max_positions: int) -> None:
        self.by_kind = {kind: RotaryEmbedding(p, head_dim, max_positions) for kind, p in params.items()}

    def tables(self, positions: Tensor, dtype: torch.dtype) -> dict[str, tuple[Tensor, Tensor]]:
        return {kind: rotary.cos_sin(positions, dtype) for kind, rotary in self.by_kind.items()}

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Every kind's tables (filling their per-device caches, which `sonar.engine.compile` does
        before tracing); returns the first layer's."""
        return next(iter(self.tables(positions, dtype).values()))


class GemmaForCausalLM(DecoderForCausalLM):
    """Gemma v1: Llama's block with Gemma's norm, scaled embeddings and GELU(tanh) MLP."""

    architectures: ClassVar[tuple[str, ...]] = ("GemmaForCausalLM",)
    generation: ClassVar[int] = 1
    refused: ClassVar[dict[str, str]] = {
        TENSOR_PARALLEL: "Gemma's layers are not split over ranks",
        PIPELINE_PARALLEL: "Gemma's layers are not split over stages",
        QUANTIZED: "Sonar serves Gemma unquantized",
        LORA: "the adapter slots are not wired into Gemma's layers",
        EAGLE: "the EAGLE heads Sonar loads are built for Llama-style targets",
    }

    def __init__(self, config: Any, parallel: TensorParallel = SINGLE, stage: PipelineStage = WHOLE) -> None:
        nn.Module.__init__(self)  # the base's layers are not Gemma's: build these instead
        if parallel.size > 1:
            self.require_support(TENSOR_PARALLEL)
        if stage.size > 1:
            self.require_support(PIPELINE_PARALLEL)
        self.config = config
        self.parallel = parallel
        self.stage = stage
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.spec = GemmaSpec(config, self.head_dim, self.generation)
        self.num_layers = config.num_hidden_layers
        self.vocab_size = config.vocab_size
        self.model = GemmaModel(config, self.spec, self.head_dim)
        self.own_layers: list[GemmaDecoderLayer] = list(self.model.layers)
        self.num_kv_heads = self.own_layers[0].self_attn.num_kv_heads
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.fused_decode = FusedDecode(self)  # never serves: Gemma has no `DecoderVariant`
        self.rotary = LayerRotary(
            rope_by_kind(config, self.spec.layer_kinds), self.head_dim, getattr(config, "max_position_embeddings", 0)
        )

    def embed(self, input_ids: Tensor) -> Tensor:
        """The token embeddings scaled by sqrt(hidden_size) rounded to the model's dtype, as
        transformers' scaled embedding layer gives them (its ``get_input_embeddings``)."""
        x = self.model.embed_tokens(input_ids)
        # a fill, not a host-to-device copy, so a CUDA graph can capture it
        return x * torch.full((), self.config.hidden_size**0.5, device=x.device).to(x.dtype)

    def forward_tensors(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[Tensor],
        hidden: Tensor | None = None,
        residual: Tensor | None = None,
    ) -> Any:
        """`DecoderForCausalLM.forward_tensors` for Gemma's layers (one whole model: no stages).
        A given `hidden` is `embed`'s output (already scaled)."""
        x = self.embed(input_ids) if hidden is None else hidden
        tables = self.rotary.tables(positions, x.dtype)
        for layer, kv_cache in zip(self.own_layers, kv_caches, strict=True):
            x, residual = layer(x, residual, *tables[layer.kind], kv_cache)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        logits = super().compute_logits(hidden)
        cap = self.spec.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


class Gemma2ForCausalLM(GemmaForCausalLM):
    """Gemma 2: sandwich norms, ``query_pre_attn_scalar``, attention and final logit soft-capping,
    sliding/global layers."""

    architectures = ("Gemma2ForCausalLM",)
    generation = 2


class Gemma3ForCausalLM(GemmaForCausalLM):
    """Gemma 3 (text): Gemma 2's layers plus per-head q/k norms and a local rope for sliding layers."""

    architectures = ("Gemma3ForCausalLM",)
    generation = 3
