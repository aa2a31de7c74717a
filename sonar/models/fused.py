"""A decode step's decoder layers in one native call (``torch.ops.sonar_cpu.decode_layers``).

On the CPU a small model's decode step is short enough that Python's share of it shows: each layer
makes about ten operator calls (norms, linears, rotary, the KV write, attention), each with its
module call, dispatch checks and argument parsing — ~4 ms of a 28 ms step at batch 16 for
SmolLM2-135M on 2 cores. `FusedDecode` hands the whole layer loop of a step whose rows are all
decodes to one C++ function that calls the same native kernels in the same order, so the result is
bit for bit the per-op path's (`tests/models/test_fused.py` checks it).

It serves only what those kernels serve (and one whole model: the loop makes no collective calls): CPU tensors in one of `ops.NATIVE_DTYPES`, a KV cache of
the model's dtype, no per-head q/k norm (Qwen3 keeps the per-op path), every linear packed for
Sonar's bf16 kernel, a plain ``nn.Linear``, or (bfloat16 and float32 models) a `QuantLinear` on the native
quantized backend without an act-order permutation; the kinds and quantized formats may differ from
one linear to the next (a GGUF Q4_K_M file mixes int4 and int8 layers). A `LoRALinear` serves as its
base layer does, its adapters in the model's dtype added after it by the same native ``lora_add``
the per-op path calls, for the rows of the step's `LoRAContext`. Anything else — prefills,
mixed steps, CUDA, code that ``torch.compile`` traces, ``SONAR_NATIVE_KERNELS=0`` — takes the per-op path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from sonar.kernels import linear as packed_linear
from sonar.kernels import ops, quant_cpu
from sonar.kernels.attention import AttentionMetadata
from sonar.kernels.quant_linear import QuantLinear
from sonar.models.lora import LoRAContext, LoRALinear

#: How ``decode_layers`` runs a linear layer (its ``kinds``): a plain matrix through ``at::linear``,
#: packed for ``linear_bf16``, or packed for ``linear_quant``: `QUANTIZED` + 2 * format code + offsets.
PLAIN, PACKED_BF16, QUANTIZED = 0, 1, 2


@dataclass(frozen=True)
class LayerWeights:
    """The decoder's tensors as ``decode_layers`` takes them: lists over the layers."""

    input_norms: list[Tensor]
    qkv: list[Tensor]
    qkv_bias: list[Tensor]
    o: list[Tensor]
    o_bias: list[Tensor]
    post_norms: list[Tensor]
    gate_up: list[Tensor]
    mlp_bias: list[Tensor]
    down: list[Tensor]
    final_norm: Tensor
    windows: list[int]
    kinds: list[int]  # four per layer: qkv, o, gate_up, down
    groups: list[int]  # the quantized layers' group sizes (0 for the others)
    lora_a: list[Tensor]  # four per layer as `kinds` (an empty tensor: no adapters); [] without LoRA
    lora_b: list[Tensor]
    lora_layers: list[LoRALinear | None]  # four per layer as `kinds` (None: no adapters); [] without LoRA
    lora_context: LoRAContext | None  # the adapters' rows of each step; None without LoRA

    def lora_b_packed(self) -> list[Tensor]:
        """Each layer's B as the native kernel reads it (an empty tensor: ``b`` itself), packed
        again where an adapter was written since the last step."""
        empty = torch.empty(0)
        packed = [empty if layer is None else layer.packed_b() for layer in self.lora_layers]
        return [empty if p is None else p for p in packed]


def _weight(layer: nn.Module) -> tuple[Tensor, int, int] | None:
    """A linear layer's weight as the native call reads it, its kind and its group size (a
    `LoRALinear`'s base layer's); None when the layer is something else (oneDNN's packing, another
    quantized backend, act-order, another wrapper)."""
    layer = _base(layer)
    if isinstance(layer, packed_linear.PackedLinear):
        return (layer.packed, PACKED_BF16, 0) if layer.native_layout else None
    if type(layer) is nn.Linear:
        return layer.weight, PLAIN, 0
    if isinstance(layer, QuantLinear) and layer.backend.name == quant_cpu.NativeBackend.name:
        meta = layer.meta
        if meta.has_perm:
            return None
        kind = QUANTIZED + 2 * quant_cpu.FORMAT_CODES[meta.format] + int(meta.has_offsets)
        return layer.packed["packed"], kind, meta.group
    return None


def layer_weights(model: nn.Module) -> LayerWeights | None:
    """The weights of a `DecoderForCausalLM` for ``decode_layers``, or None when its layers are
    not all of the kinds the native call serves."""
    variant = getattr(model, "variant", None)  # None: a family with layers of its own (Gemma)
    if variant is None or not variant.native_decode or variant.qk_norm or variant.mlp_factory is not None:
        return None
    if model.parallel.size > 1 or model.stage.size > 1:  # one whole model only
        return None
    lists: dict[str, list[Tensor]] = {
        k: [] for k in ("input_norms", "qkv", "qkv_bias", "o", "o_bias", "post_norms", "gate_up", "mlp_bias", "down")
    }
    kinds: list[int] = []
    groups: list[int] = []
    quantized: set[int] = set()  # ids of the packed quantized weights: bytes, not the model's dtype
    adapters = _Adapters()
    hidden = model.config.hidden_size
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not attn.whole_rotary:  # the native rotary turns whole heads, in halves
            return None
        linears = {"qkv": attn.qkv_proj, "o": attn.o_proj, "gate_up": mlp.gate_up_proj, "down": mlp.down_proj}
        inter = mlp.intermediate
        splits = {
            "qkv": (attn.q_size, attn.kv_size, attn.kv_size),
            "o": (hidden,),
            "gate_up": (inter, inter),
            "down": (hidden,),
        }
        for name, module in linears.items():
            found = _weight(module)
            if found is None or not adapters.add(module, splits[name]):
                return None
            weight, kind, group = found
            lists[name].append(weight)
            kinds.append(kind)
            groups.append(group)
            if kind >= QUANTIZED:
                quantized.add(id(weight))
        for name, biases in (
            ("qkv_bias", (attn.qkv_proj,)),
            ("o_bias", (attn.o_proj,)),
            ("mlp_bias", (mlp.gate_up_proj, mlp.down_proj)),
        ):
            lists[name].extend(m.bias for m in map(_base, biases) if m.bias is not None)
        lists["input_norms"].append(layer.input_layernorm.weight)
        lists["post_norms"].append(layer.post_attention_layernorm.weight)
    final_norm = model.model.norm.weight
    # the quantized weights are bytes, on the CPU (where their backend serves them)
    typed = [t for values in lists.values() for t in values if id(t) not in quantized]
    if not ops.use_native(final_norm, *typed, *adapters.tensors()):
        return None
    if quantized and final_norm.dtype not in quant_cpu.ACTIVATION_DTYPES:
        return None
    return LayerWeights(
        **lists,
        final_norm=final_norm,
        windows=[layer.self_attn.sliding_window or -1 for layer in model.model.layers],
        kinds=kinds,
        groups=groups,
        lora_a=adapters.a if adapters.context else [],
        lora_b=adapters.b if adapters.context else [],
        lora_layers=adapters.layers if adapters.context else [],
        lora_context=adapters.context,
    )


def _base(layer: nn.Module) -> nn.Module:
    return layer.base if isinstance(layer, LoRALinear) else layer


class _Adapters:
    """The LoRA tensors of a model's linear layers, four per layer, and the one context they share."""

    def __init__(self) -> None:
        self.a: list[Tensor] = []
        self.b: list[Tensor] = []
        self.layers: list[LoRALinear | None] = []
        self.context: LoRAContext | None = None

    def add(self, layer: nn.Module, splits: tuple[int, ...]) -> bool:
        """Record `layer`'s adapters (empty tensors for a layer without); False when the native
        call cannot serve them: sub-projections other than the model's, or another context."""
        if not isinstance(layer, LoRALinear):
            self.a.append(torch.empty(0))
            self.b.append(torch.empty(0))
            self.layers.append(None)
            return True
        if tuple(layer.splits) != splits or (self.context is not None and layer.context is not self.context):
            return False
        self.context = layer.context
        self.a.append(layer.a)
        self.b.append(layer.b)
        self.layers.append(layer)
        return True

    def tensors(self) -> list[Tensor]:
        return [t for t in (*self.a, *self.b) if t.numel()]


class FusedDecode:
    """`run` serves a model's decode-only steps through the native layer loop; built lazily,
    rebuilt when packed weights change (`sonar.kernels.linear.pack_generation`)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._generation = -1
        self._weights: LayerWeights | None = None

    def weights(self) -> LayerWeights | None:
        generation = packed_linear.pack_generation()
        if generation != self._generation:
            self._weights = layer_weights(self.model)
            self._generation = generation
        return self._weights

    def serves(self, kv_caches: list[Tensor], meta: AttentionMetadata) -> bool:
        """Whether this step can take the native layer loop: every row a decode, on the CPU, the
        caches in the model's dtype, the kernels enabled, not under ``torch.compile``."""
        if meta.max_query_len != 1 or meta.num_tokens != meta.num_seqs or not ops.use_native(*kv_caches):
            return False
        if packed_linear.onednn_serves(meta.num_tokens):  # the per-op path's oneDNN products, bit for bit
            return False
        weights = self.weights()
        return weights is not None and weights.final_norm.dtype == kv_caches[0].dtype

    def run(self, input_ids: Tensor, positions: Tensor, kv_caches: list[Tensor], meta: AttentionMetadata) -> Tensor:
        """The final hidden states ``[num_seqs, hidden_size]`` of a step `serves` accepted."""
        model, w = self.model, self._weights
        x = model.model.embed_tokens(input_ids)
        cos, sin = model.rotary.cos_sin(positions, x.dtype)
        attn = model.model.layers[0].self_attn
        return torch.ops.sonar_cpu.decode_layers(
            x,
            cos,
            sin,
            w.input_norms,
            w.qkv,
            w.qkv_bias,
            w.o,
            w.o_bias,
            w.post_norms,
            w.gate_up,
            w.mlp_bias,
            w.down,
            w.final_norm,
            kv_caches,
            meta.slot_mapping,
            meta.block_tables,
            meta.seq_lens,
            w.windows,
            attn.num_heads,
            model.model.norm.eps,
            attn.scale,
            w.kinds,
            w.groups,
            w.lora_a,
            w.lora_b,
            w.lora_context.rows if w.lora_context else None,
            w.lora_b_packed() if w.lora_context and w.lora_context.rows is not None else [],
        )
