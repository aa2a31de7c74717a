"""GPT-OSS (``GptOssForCausalLM``): OpenAI's open-weight mixture-of-experts decoder, as
transformers computes it.

Its layers are Llama's block (RMSNorm, attention, RMSNorm, MLP) with:

* biases on q/k/v/o (``attention_bias``), and one learned *sink* logit per query head
  (``self_attn.sinks``) that joins each softmax's denominator with no value, through every
  attention path (`sonar.kernels.ops.paged_attention`);
* sliding-window (``sliding_window``, 128 in the published models) and full layers alternating by
  ``layer_types``; YaRN rope (``truncate: false``, `sonar.models.rotary`);
* a sparse block in every layer: a router with a bias, the ``top_k`` largest logits softmaxed
  among themselves (`sonar.kernels.moe.route_topk_softmax`), experts with biases and the clamped
  SwiGLU (``swiglu_limit``, ``swiglu_alpha``), through the fused MoE operator's GPT-OSS option.

transformers stores the experts stacked and transposed: ``experts.gate_up_proj`` ``[E, h, 2 I]``
with gate and up in alternating columns, ``experts.down_proj`` ``[E, I, h]``, and their biases
``[E, 2 I]`` (alternating too) / ``[E, h]``. `GptOssForCausalLM.load_weights` de-interleaves and
transposes them into the operator's ``[E, 2 I, h]`` (gate rows, then up rows) / ``[E, h, I]``.

A ``gpt-oss`` GGUF file converts to this layout too (`sonar.models.gguf_arch`); experts it stores
in a block type Sonar serves quantized (MXFP4 in the published files, Q8_0, ...) stay quantized
(`GptOssForCausalLM.prepare_quantized`): the block's experts become `QuantizedExperts`, one
`QuantLinear` per expert and projection (gate and up stacked, as the operator's rows) with the
biases beside them, on the CPU. The published safetensors checkpoints' MXFP4 experts
(``quantization_config`` ``quant_method: mxfp4``, `sonar.models.quantization.mxfp4`) take the same
path. Not served, each refused naming the feature: other quantization methods, LoRA adapters,
EAGLE heads, tensor and pipeline parallelism; the native decode loop (`sonar.models.fused`) leaves
these layers alone.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import replace
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from sonar.kernels.attention_op import attention
from sonar.kernels.moe import fused_experts, route_topk_softmax
from sonar.kernels.quant import QuantizationError, QuantizedWeight, stack_rows
from sonar.models.decoder import (
    EAGLE,
    LORA,
    PIPELINE_PARALLEL,
    QUANTIZED,
    TENSOR_PARALLEL,
    Attention,
    DecoderForCausalLM,
    DecoderLayer,
    DecoderVariant,
    sliding_windows,
)
from sonar.models.errors import ModelLoadError
from sonar.models.moe import QuantizedExperts
from sonar.models.parallel import SINGLE, WHOLE, PipelineStage, TensorParallel

SLIDING, FULL = "sliding_attention", "full_attention"


class SinkAttention(Attention):
    """`Attention` with a learned sink logit per query head."""

    def __init__(
        self, config: Any, variant: DecoderVariant, layer: int, head_dim: int, parallel: TensorParallel = SINGLE
    ) -> None:
        super().__init__(config, variant, layer, head_dim, parallel)
        self.sinks = nn.Parameter(torch.empty(self.num_heads))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor) -> Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size :].view(n, self.num_kv_heads, self.head_dim)
        qk = self.rotate(qkv[:, : self.q_size + self.kv_size].view(n, -1, self.head_dim), cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        o = attention(q, k, v, kv_cache, self.scale, self.sliding_window, sinks=self.sinks)
        return self.o_proj(o.reshape(n, self.q_size))


class GptOssExperts(nn.Module):
    """The experts' weights in the fused operator's layout: ``gate_up_proj`` ``[E, 2 I, h]`` (each
    expert's gate rows, then its up rows), ``down_proj`` ``[E, h, I]``, and their biases."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape), requires_grad=False)

        self.gate_up_proj = param(num_experts, 2 * intermediate, hidden)
        self.gate_up_proj_bias = param(num_experts, 2 * intermediate)
        self.down_proj = param(num_experts, hidden, intermediate)
        self.down_proj_bias = param(num_experts, hidden)


class GptOssMoeBlock(nn.Module):
    """The router (``router``, with a bias) and the experts, run by the fused operator (or, GGUF
    quants, by `QuantizedExperts`)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.limit = float(config.swiglu_limit)
        self.alpha = float(config.swiglu_alpha)
        self.intermediate = config.intermediate_size
        self.router = nn.Linear(config.hidden_size, config.num_local_experts, bias=True)
        self.experts: GptOssExperts | QuantizedExperts = GptOssExperts(
            config.num_local_experts, config.hidden_size, config.intermediate_size
        )

    def forward(self, x: Tensor) -> Tensor:
        weights, ids = route_topk_softmax(self.router(x), self.top_k)
        e = self.experts
        if isinstance(e, QuantizedExperts):
            return e(x, weights, ids)
        return fused_experts(
            x, weights, ids, e.gate_up_proj, e.down_proj, e.gate_up_proj_bias, e.down_proj_bias, self.limit, self.alpha
        )


class GptOssDecoderLayer(DecoderLayer):
    """Llama's block with `SinkAttention` in place of `Attention` (the MLP is the variant's)."""

    def __init__(
        self, config: Any, variant: DecoderVariant, layer: int, head_dim: int, parallel: TensorParallel = SINGLE
    ) -> None:
        super().__init__(config, variant, layer, head_dim, parallel)
        self.self_attn = SinkAttention(config, variant, layer, head_dim, parallel)


_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias)")


def _deinterleave(t: Tensor) -> Tensor:
    """Alternating gate/up entries along the last dim -> the gate half, then the up half."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


class GptOssForCausalLM(DecoderForCausalLM):
    architectures: ClassVar[tuple[str, ...]] = ("GptOssForCausalLM",)
    layer_class = GptOssDecoderLayer
    refused: ClassVar[dict[str, str]] = {
        TENSOR_PARALLEL: "GPT-OSS's sinks and experts are not split over ranks",
        PIPELINE_PARALLEL: "GPT-OSS's layers are not split over stages",
        QUANTIZED: "Sonar serves GPT-OSS's quantized experts from MXFP4 checkpoints and GGUF files only",
        LORA: "the adapters' target modules are dense MLPs, and a mixture-of-experts layer has none",
        EAGLE: "the EAGLE heads Sonar loads are built for dense, Llama-style targets",
    }

    def __init__(self, config: Any, parallel: TensorParallel = SINGLE, stage: PipelineStage = WHOLE) -> None:
        quant = getattr(config, "quantization_config", None)
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", quant)
        if quant is not None and str(method) != "mxfp4":
            raise ModelLoadError(
                f"GptOssForCausalLM: quantization_config quant_method {method!r} is not supported "
                "(GPT-OSS's quantized checkpoints are read with mxfp4 only)"
            )
        super().__init__(config, parallel, stage)

    @classmethod
    def make_variant(cls, config: Any) -> DecoderVariant:
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":  # transformers' GPT-OSS experts ignore it: refuse anything that claims otherwise
            raise ModelLoadError(f"GptOssForCausalLM: hidden_act {act!r} is not supported (only silu)")
        kinds = list(getattr(config, "layer_types", None) or [])
        unknown = sorted(set(kinds) - {SLIDING, FULL})
        if unknown or len(kinds) != config.num_hidden_layers:
            raise ModelLoadError(
                f"GptOssForCausalLM: layer_types {kinds} are not {config.num_hidden_layers} of {SLIDING!r} / {FULL!r}"
            )
        bias = bool(getattr(config, "attention_bias", True))
        return replace(
            DecoderForCausalLM.make_variant(config),
            qkv_bias=bias,
            o_bias=bias,
            sliding_windows=sliding_windows(config),
            native_decode=False,
            mlp_factory=lambda config, variant, layer, parallel: GptOssMoeBlock(config),
        )

    def stacked_params(self) -> dict[str, tuple[str, int, int]]:
        """Only q/k/v: the experts are placed by `load_weights`."""
        attn = self.own_layers[0].self_attn
        q, kv = attn.q_size, attn.kv_size
        return {
            ".q_proj.": (".qkv_proj.", 0, q),
            ".k_proj.": (".qkv_proj.", q, kv),
            ".v_proj.": (".qkv_proj.", q + kv, kv),
        }

    def prepare_quantized(self, weights: dict[str, QuantizedWeight]) -> dict[str, QuantizedWeight]:
        """Before `install_quantized`: a block whose experts' projections are all quantized
        (``mlp.experts.E.gate_proj`` / ``up_proj`` / ``down_proj``, as a GGUF file's stacked
        experts arrive) gets `QuantizedExperts`, each expert's gate and up stacked into its
        ``gate_up_proj``. The biases already read move into the new module; those still to
        come are read into it by `load_weights`."""
        out = dict(weights)
        for i, layer in enumerate(self.model.layers):
            block = layer.mlp
            prefix = f"model.layers.{i}.mlp.experts"
            if not isinstance(block, GptOssMoeBlock) or not any(n.startswith(f"{prefix}.") for n in out):
                continue
            experts = block.experts
            assert isinstance(experts, GptOssExperts)
            count, two_i, hidden = experts.gate_up_proj.shape
            parts = ("gate_proj", "up_proj", "down_proj")
            lacking = [f"{prefix}.{e}.{p}" for e in range(count) for p in parts if f"{prefix}.{e}.{p}" not in out]
            if lacking:
                raise ModelLoadError(
                    f"GptOssForCausalLM: some of {prefix}'s projections are stored in a block type Sonar serves "
                    f"quantized and some not ({lacking[0]} is not); serve it with --dequantize-weights"
                )
            device = experts.gate_up_proj.device
            for e in range(count):
                gate, up = f"{prefix}.{e}.gate_proj", f"{prefix}.{e}.up_proj"
                try:
                    out[f"{prefix}.{e}.gate_up_proj"] = stack_rows([out.pop(gate), out.pop(up)])
                except QuantizationError as exc:
                    raise ModelLoadError(f"{gate} and {up} cannot be served as one quantized matrix: {exc}") from exc
            with torch.device("meta"):  # places for the quantized layers, which bring their own tensors
                quantized = QuantizedExperts(
                    count,
                    hidden,
                    two_i // 2,
                    swiglu_limit=block.limit,
                    swiglu_alpha=block.alpha,
                    bias_device=device,
                    bias_dtype=experts.gate_up_proj_bias.dtype,
                )
            assert quantized.gate_up_proj_bias is not None and quantized.down_proj_bias is not None
            quantized.gate_up_proj_bias.data.copy_(experts.gate_up_proj_bias)
            quantized.down_proj_bias.data.copy_(experts.down_proj_bias)
            block.experts = quantized
        return out

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        placed: set[str] = set()

        def rest() -> Iterable[tuple[str, Tensor]]:
            for name, tensor in weights:
                found = _EXPERTS.fullmatch(name)
                if found is None:
                    yield name, tensor
                    continue
                kind = found[2]
                if kind == "gate_up_proj":
                    tensor = _deinterleave(tensor).transpose(1, 2)
                elif kind == "gate_up_proj_bias":
                    tensor = _deinterleave(tensor)
                elif kind == "down_proj":
                    tensor = tensor.transpose(1, 2)
                dest = params[name].data
                if tuple(dest.shape) != tuple(tensor.shape):
                    raise ModelLoadError(
                        f"weight {name} has shape {tuple(tensor.shape)} after the layout change, "
                        f"the model expects {tuple(dest.shape)}"
                    )
                dest.copy_(tensor)
                placed.add(name)

        return super().load_weights(rest()) | placed
