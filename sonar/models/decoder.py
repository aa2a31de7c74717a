"""The decoder-only transformer shared by the Llama, Mistral, Qwen2 and Qwen3 families, and the
layers the other dense families (Phi-3, Granite, OLMo 2, GLM-4) build theirs from.

The families differ in a few switches, gathered in `DecoderVariant`: biases on the q/k/v
projections (Qwen2 always, others by `attention_bias`), an RMSNorm over each query and key head
before the rotation (Qwen3), sliding-window layers (Mistral, Qwen2/3 by `layer_types`), the
rope scaling (Llama 3) and tied input/output embeddings (SmolLM2, small Qwens), a partial or
interleaved rotary (GLM-4) and the attention's scale (Granite). A family whose layer is arranged
differently (norms after the attention and the MLP) names its own `layer_class`.

Everything runs over a *flat* batch: ``input_ids``/``positions`` ``[num_tokens]`` hold the new
tokens of every sequence of the step, and `AttentionMetadata` says which rows belong to which
sequence and where their context lives in the paged KV cache.

Module and parameter names follow the Hugging Face checkpoints, except that q/k/v are one
``qkv_proj`` and gate/up one ``gate_up_proj`` (fewer, larger matmuls); `load_weights` maps the
checkpoint's separate tensors into their slices.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from sonar.kernels import ops
from sonar.kernels.attention import AttentionMetadata
from sonar.kernels.attention_op import attention, step_metadata
from sonar.kernels.quant import QuantizedWeight
from sonar.models.errors import ModelLoadError
from sonar.models.fused import FusedDecode
from sonar.models.parallel import SINGLE, WHOLE, PipelineStage, Shard, TensorParallel
from sonar.models.rotary import (
    RotaryEmbedding,
    apply_partial_rotary,
    longrope_switch,
    rope_parameters,
    rotary_dim,
)

#: Features a family may refuse (`DecoderForCausalLM.refused`), by the names its errors give them.
TENSOR_PARALLEL = "tensor parallelism"
PIPELINE_PARALLEL = "pipeline parallelism"
LORA = "LoRA adapters"
QUANTIZED = "quantized weights"
EAGLE = "EAGLE speculative decoding"


def unverified(*features: str) -> dict[str, str]:
    """`DecoderForCausalLM.refused` entries for features a family's layers have not been checked with."""
    return dict.fromkeys(features, "not yet verified against transformers for this architecture")


@dataclass(frozen=True)
class DecoderVariant:
    """The switches that tell one family from another."""

    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    mlp_bias: bool
    sliding_windows: tuple[int | None, ...]
    interleaved_rotary: bool = False
    """The rotary turns pairs ``2i, 2i + 1`` (GLM) instead of ``i, i + rotary_dim / 2``."""
    attention_scale: float | None = None
    """The softmax scale (Granite's `attention_multiplier`); None: ``head_dim ** -0.5``."""
    native_decode: bool = True
    """Whether the layers are exactly what the native decode loop computes (`sonar.models.fused`)."""
    mlp_factory: Callable[[Any, DecoderVariant, int, TensorParallel], nn.Module] | None = None
    """Builds layer i's MLP in place of the dense `MLP` (mixture-of-experts families, `sonar.models.moe`)."""


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and cast back before the weight multiplies
    (`sonar.kernels.ops.rms_norm`: the Triton kernel on CUDA, this same formula on CPU)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """The norm of ``x``; with ``residual``, ``x + residual`` first, returned beside the norm
        (one pass: the residual stream's add fused into the next norm)."""
        return ops.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    """Self-attention over this rank's heads (all of them without tensor parallelism)."""

    def __init__(
        self, config: Any, variant: DecoderVariant, layer: int, head_dim: int, parallel: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.num_heads = parallel.split(config.num_attention_heads, "number of attention heads")
        self.num_kv_heads, self.first_kv_head = parallel.kv_heads(
            config.num_key_value_heads or config.num_attention_heads
        )
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.scale = variant.attention_scale or head_dim**-0.5
        self.rotary_dim = rotary_dim(rope_parameters(config), head_dim)
        self.interleaved_rotary = variant.interleaved_rotary
        self.whole_rotary = self.rotary_dim == head_dim and not variant.interleaved_rotary
        self.sliding_window = variant.sliding_windows[layer]
        hidden = config.hidden_size
        self.qkv_proj = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=variant.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=variant.o_bias)
        if variant.qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.qk_norm = variant.qk_norm

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor) -> Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size :].view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.rotate(self.q_norm(q.view(n, self.num_heads, self.head_dim)), cos, sin)
            k = self.rotate(self.k_norm(k.view(n, self.num_kv_heads, self.head_dim)), cos, sin)
        else:  # rotate queries and keys in one go: half the small ops of a decode step's rotary
            qk = qkv[:, : self.q_size + self.kv_size].view(n, -1, self.head_dim)
            qk = ops.apply_rotary(qk, cos, sin) if self.whole_rotary else self.rotate(qk, cos, sin)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        o = attention(q, k, v, kv_cache, self.scale, self.sliding_window)
        return self.parallel.all_reduce(self.o_proj(o.reshape(n, self.q_size)))

    def rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """``x`` ``[num_tokens, heads, head_dim]`` rotated by the step's cos/sin."""
        if self.whole_rotary:
            return ops.apply_rotary(x, cos, sin)
        return apply_partial_rotary(x, cos, sin, self.interleaved_rotary)


class MLP(nn.Module):
    """The gated SiLU MLP over this rank's slice of the intermediate size."""

    def __init__(self, config: Any, variant: DecoderVariant, parallel: TensorParallel = SINGLE) -> None:
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"hidden_act {act!r} is not supported (only silu)")
        self.parallel = parallel
        self.intermediate = parallel.split(config.intermediate_size, "intermediate size")
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate, bias=variant.mlp_bias)
        self.down_proj = nn.Linear(self.intermediate, config.hidden_size, bias=variant.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.parallel.all_reduce(self.down_proj(ops.silu_and_mul(self.gate_up_proj(x))))


class DecoderLayer(nn.Module):
    def __init__(
        self, config: Any, variant: DecoderVariant, layer: int, head_dim: int, parallel: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, variant, layer, head_dim, parallel)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        make_mlp = variant.mlp_factory
        self.mlp = MLP(config, variant, parallel) if make_mlp is None else make_mlp(config, variant, layer, parallel)

    def forward(
        self, x: Tensor, residual: Tensor | None, cos: Tensor, sin: Tensor, kv_cache: Tensor
    ) -> tuple[Tensor, Tensor]:
        """``x``: the previous layer's output before its residual add (the embeddings, with
        ``residual`` None, for the first layer). Returns this layer's output and the residual
        stream it is to be added to: each add happens inside the next norm."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


def vocab_parallel_lookup(ids: Tensor, first: int, rows: int, lookup: Any, parallel: TensorParallel) -> Tensor:
    """Embeddings of `ids` when this rank holds the vocabulary rows ``first .. first + rows``
    (`lookup` of local row indices): ids outside them look up zeros, and the all-reduce fills every
    row from its owner."""
    local = ids - first
    outside = (local < 0) | (local >= rows)
    x = lookup(local.masked_fill(outside, 0))
    return parallel.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0))


class VocabParallelEmbedding(nn.Embedding):
    """The embedding rows ``first .. first + rows`` of a vocabulary split over a tensor-parallel group."""

    def __init__(self, rows: int, hidden: int, first: int, parallel: TensorParallel) -> None:
        super().__init__(rows, hidden, _weight=torch.empty(rows, hidden))
        self.first = first
        self.parallel = parallel

    def forward(self, ids: Tensor) -> Tensor:
        return vocab_parallel_lookup(ids, self.first, self.num_embeddings, super().forward, self.parallel)


class VocabParallelLookup(nn.Module):
    """A quantized embedding (`QuantEmbedding`) of this rank's vocabulary rows, looked up as
    `VocabParallelEmbedding` looks up its own."""

    def __init__(self, inner: nn.Module, first: int, parallel: TensorParallel) -> None:
        super().__init__()
        self.inner = inner
        self.first = first
        self.parallel = parallel
        self.num_embeddings = inner.num_embeddings
        self.embedding_dim = inner.embedding_dim

    def forward(self, ids: Tensor) -> Tensor:
        return vocab_parallel_lookup(ids, self.first, self.num_embeddings, self.inner, self.parallel)


class MissingLayer(nn.Module):
    """A decoder layer another pipeline stage holds: no weights here, never called."""


class DecoderModel(nn.Module):
    def __init__(
        self,
        config: Any,
        variant: DecoderVariant,
        head_dim: int,
        parallel: TensorParallel = SINGLE,
        owned: range | None = None,
        layer_class: type[nn.Module] = DecoderLayer,
    ) -> None:
        super().__init__()
        owned = range(config.num_hidden_layers) if owned is None else owned
        if parallel.size == 1:
            # the weight given: no random init, whose meta-device kernel would import torch._dynamo (seconds)
            self.embed_tokens = nn.Embedding(
                config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
            )
        else:
            rows, first = parallel.vocab_rows(config.vocab_size)
            self.embed_tokens = VocabParallelEmbedding(rows, config.hidden_size, first, parallel)
        # layer i keeps its index (and its checkpoint names) on every stage
        self.layers = nn.ModuleList(
            layer_class(config, variant, i, head_dim, parallel) if i in owned else MissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DecoderForCausalLM(nn.Module):
    """Base of every causal LM Sonar serves; subclasses pick the `variant` for their family.

    The runner's contract: `forward` over a flat batch returns the final hidden states
    ``[num_tokens, hidden_size]``; `compute_logits` turns the rows it selects (the last token of
    each sequence, or every prompt token when prompt logprobs are asked) into float32 logits.
    """

    architectures: ClassVar[tuple[str, ...]] = ()
    is_causal: ClassVar[bool] = True
    layer_class: ClassVar[type[nn.Module]] = DecoderLayer
    """The decoder layer: ``(config, variant, index, head_dim, parallel)``, called as `DecoderLayer`
    is (its output before the residual add, and the residual stream)."""
    refused: ClassVar[dict[str, str]] = {}
    """Features this family is not served with, each with the reason (`require_support`)."""

    def __init__(self, config: Any, parallel: TensorParallel = SINGLE, stage: PipelineStage = WHOLE) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel
        """This rank's place in its tensor-parallel group (`sonar.models.parallel`): the layers
        hold its shards, and `num_kv_heads` counts the KV heads its cache holds."""
        self.stage = stage
        """The pipeline stage this process runs: `num_layers` counts its layers (its KV caches)."""
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        owned = stage.owned(config.num_hidden_layers)
        self.num_layers = len(owned)
        self.vocab_size = config.vocab_size
        self.variant = self.make_variant(config)
        if parallel.size > 1:
            self.require_support(TENSOR_PARALLEL)
        if stage.size > 1:
            self.require_support(PIPELINE_PARALLEL)
        self.model = DecoderModel(config, self.variant, self.head_dim, parallel, owned, self.layer_class)
        self.own_layers: list[DecoderLayer] = [self.model.layers[i] for i in owned]
        self.num_kv_heads = self.own_layers[0].self_attn.num_kv_heads
        self.lm_head = nn.Linear(config.hidden_size, self.model.embed_tokens.num_embeddings, bias=False)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.fused_decode = FusedDecode(self)
        """Decode-only CPU steps in one native call (`sonar.models.fused`)."""
        rope = rope_parameters(config)
        max_positions = getattr(config, "max_position_embeddings", 0)
        self.rotary = RotaryEmbedding(rope, self.head_dim, max_positions)
        self.longrope_switch = longrope_switch(rope, max_positions)
        """LongRoPE: the length past which a sequence takes the long factors (the scheduler's
        `SchedulerConfig.longrope_switch`); None for other rope types."""

    @classmethod
    def make_variant(cls, config: Any) -> DecoderVariant:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderVariant(
            qkv_bias=bias,
            o_bias=bias,
            qk_norm=False,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            sliding_windows=sliding_windows(config),
        )

    @classmethod
    def require_support(cls, feature: str) -> None:
        """A `ModelLoadError` naming the family and `feature` when the family refuses it."""
        reason = cls.refused.get(feature)
        if reason is not None:
            raise ModelLoadError(f"{cls.__name__} is not served with {feature}: {reason}")

    def embed(self, input_ids: Tensor) -> Tensor:
        """The first layer's input for `input_ids`."""
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[Tensor],
        attn_metadata: AttentionMetadata,
    ) -> Tensor:
        if self.fused_decode.serves(kv_caches, attn_metadata):
            return self.fused_decode.run(input_ids, positions, kv_caches, attn_metadata)
        with step_metadata(attn_metadata):
            return self.forward_tensors(input_ids, positions, kv_caches)

    def forward_rows(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[Tensor],
        attn_metadata: AttentionMetadata,
        rows: Tensor,
        embeds: Tensor,
    ) -> Tensor:
        """`forward` with the first layer's input given at `rows` (``embeds``, one per row): an
        image's feature rows, or a prompt given as embeddings. Always eager: compiled forms and
        CUDA graphs take token ids alone."""
        x = self.embed(input_ids)
        x[rows] = embeds.to(x.dtype)
        with step_metadata(attn_metadata):
            return self.forward_tensors(input_ids, positions, kv_caches, hidden=x)

    def forward_tensors(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[Tensor],
        hidden: Tensor | None = None,
        residual: Tensor | None = None,
    ) -> Any:
        """`forward` on tensors alone, what ``torch.compile`` takes (`sonar.engine.compile`): the
        layers' attention reads the step's metadata that `step_metadata` made current.

        A pipeline stage after the first takes the previous stage's `hidden` and `residual`
        instead of embedding `input_ids`; a stage before the last returns its own pair."""
        x = self.embed(input_ids) if hidden is None else hidden
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for layer, kv_cache in zip(self.own_layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos, sin, kv_cache)
        if not self.stage.last:
            return x, residual
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """``[n, hidden_size]`` selected hidden states to float32 logits ``[n, vocab_size]`` (with
        tensor parallelism, on every rank, padded to a multiple of the group's size)."""
        return self.parallel.gather_last(self.lm_head(hidden)).float()

    def checkpoint_shard(self, name: str) -> Shard | None:
        """This rank's part of the checkpoint tensor `name` (None: all of it; `sonar.models.parallel`)."""
        tp = self.parallel
        if tp.size == 1:
            return None
        attn, mlp = self.own_layers[0].self_attn, self.own_layers[0].mlp
        if ".q_proj." in name:
            return Shard(0, tp.rank * attn.q_size, attn.q_size)
        if ".k_proj." in name or ".v_proj." in name:
            return Shard(0, attn.first_kv_head * self.head_dim, attn.kv_size)
        if ".gate_proj." in name or ".up_proj." in name:
            return Shard(0, tp.rank * mlp.intermediate, mlp.intermediate)
        if name.endswith(".o_proj.weight"):
            return Shard(1, tp.rank * attn.q_size, attn.q_size)
        if name.endswith(".down_proj.weight"):
            return Shard(1, tp.rank * mlp.intermediate, mlp.intermediate)
        if name.endswith((".o_proj.bias", ".down_proj.bias")):  # added once, after the all-reduce
            return Shard(leader_only=True, leader=tp.leader)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            rows, first = tp.vocab_rows(self.vocab_size)
            return Shard(0, first, rows)
        return None

    def shard_checkpoint(self, name: str, tensor: Tensor) -> Tensor:
        """This rank's part of the checkpoint tensor `name`."""
        shard = self.checkpoint_shard(name)
        return tensor if shard is None else shard.tensor(tensor)

    def owns(self, name: str) -> bool:
        """Whether this pipeline stage holds the checkpoint tensor (or module) `name`."""
        if not name.startswith("model.layers."):
            return True
        index = name.split(".", 3)[2]
        return not index.isdigit() or int(index) in self.stage.owned(self.config.num_hidden_layers)

    def shard_quantized(self, weights: dict[str, QuantizedWeight]) -> dict[str, QuantizedWeight]:
        """Quantized weights by module name, cut to this rank's parts of this stage's modules."""
        out = {}
        for name, qw in weights.items():
            if self.owns(name):
                shard = self.checkpoint_shard(f"{name}.weight")
                out[name] = qw if shard is None else shard.quantized(qw, name)
        return out

    def stacked_params(self) -> dict[str, tuple[str, int, int]]:
        """Checkpoint name fragment -> (fused fragment, first row, rows) of the fused matrices."""
        return stacked_params(self.own_layers[0])

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Copy checkpoint tensors (Hugging Face names) into the parameters, casting to their dtype.

        Returns the names of the parameters that were completely written (a fused parameter
        once all its slices were). Tensors the model has no place for are skipped: rotary
        caches, a tied `lm_head`, extra heads other tools add.
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        stacked = self.stacked_params()
        written: set[tuple[str, int]] = set()
        for name, tensor in weights:
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue
            tensor = self.shard_checkpoint(name, tensor)
            target_name, first, rows = fused_name(name, stacked)
            target = params.get(target_name)
            if target is None:
                continue
            dest = target.data if rows is None else target.data.narrow(0, first, rows)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    f"weight {name} has shape {tuple(tensor.shape)}, the model expects {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            written.add((target_name, first))
        slices: dict[str, set[int]] = {}
        for fused, offset, _ in stacked.values():
            slices.setdefault(fused, set()).add(offset)
        done = set()
        for name in params:
            fused = next((f for f in slices if f in name), None)
            needed = slices[fused] if fused else {0}
            if all((name, offset) in written for offset in needed):
                done.add(name)
        if self.tie_word_embeddings and "model.embed_tokens.weight" in done:
            done.add("lm_head.weight")
        return done


def stacked_params(layer: DecoderLayer) -> dict[str, tuple[str, int, int]]:
    """Checkpoint name fragment -> (fused fragment, first row, rows) of `layer`'s fused matrices."""
    q, kv, inter = layer.self_attn.q_size, layer.self_attn.kv_size, layer.mlp.intermediate
    return {
        ".q_proj.": (".qkv_proj.", 0, q),
        ".k_proj.": (".qkv_proj.", q, kv),
        ".v_proj.": (".qkv_proj.", q + kv, kv),
        ".gate_proj.": (".gate_up_proj.", 0, inter),
        ".up_proj.": (".gate_up_proj.", inter, inter),
    }


def unfuse(
    weights: Iterable[tuple[str, Tensor]], fused: dict[str, list[tuple[str, int]]]
) -> Iterator[tuple[str, Tensor]]:
    """Checkpoint tensors with the fused matrices some families store (Phi-3's ``qkv_proj``, GLM-4's
    ``gate_up_proj``: fragment -> its parts' fragments and rows, in row order) cut into the parts'
    tensors, which `DecoderForCausalLM.load_weights` stacks back (each rank's share of each part)."""
    for name, tensor in weights:
        fragment = next((f for f in fused if f in name), None)
        if fragment is None:
            yield name, tensor
            continue
        parts = fused[fragment]
        if tensor.shape[0] != sum(rows for _, rows in parts):
            raise ModelLoadError(
                f"weight {name} has {tensor.shape[0]} rows, the model expects {sum(r for _, r in parts)}"
            )
        first = 0
        for part, rows in parts:
            yield name.replace(fragment, part), tensor.narrow(0, first, rows)
            first += rows


def fused_name(name: str, stacked: dict[str, tuple[str, int, int]]) -> tuple[str, int, int | None]:
    """Where checkpoint tensor `name` goes: (parameter name, first row, rows; None: all of it)."""
    for part, (fused, offset, size) in stacked.items():
        if part in name:
            return name.replace(part, fused), offset, size
    return name, 0, None


def sliding_windows(config: Any) -> tuple[int | None, ...]:
    """Per layer, the sliding window or None, from `layer_types` where the config has them."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    n = config.num_hidden_layers
    if layer_types is not None:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    return (window,) * n
