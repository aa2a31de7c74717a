"""Mixture-of-experts decoders: the decoder of `sonar.models.decoder` with a sparse MoE block in
place of the dense MLP in some or all layers (`MoeForCausalLM`; Mixtral and Qwen2/Qwen3-MoE
subclass it).

A sparse block routes each token to ``top_k`` of ``E`` experts (``gate``, the router: a float32
softmax, the top-k, renormalized or not) and runs them through the fused operator
(`sonar.kernels.moe.fused_moe`); Qwen2-MoE adds a shared expert every token goes through, scaled
by a sigmoid gate. The experts' weights are stacked as transformers stores them in memory
(``experts.gate_up_proj`` ``[E, 2 I, h]``, ``experts.down_proj`` ``[E, h, I]``); `load_weights`
reads both checkpoint layouts: one tensor per expert and projection (what ``save_pretrained``
writes, and the published checkpoints: ``experts.N.gate_proj`` / ``up_proj`` / ``down_proj``,
Mixtral's ``block_sparse_moe.experts.N.w1`` / ``w3`` / ``w2``) and the stacked tensors.

Tensor parallelism shards each expert's (and the shared expert's) intermediate size like a dense
MLP's: every rank holds all experts, a slice of each, and one all-reduce sums the block's output.
The router and the shared expert's gate are replicated.

Expert parallelism (``--enable-expert-parallel``, `TensorParallel.expert_placement`) deals the
experts, whole, over the same ranks instead (`TensorParallel.local_experts`: contiguous ranges or
round robin). Every rank has every token (tensor parallelism replicates the activations), so a rank
computes the (token, expert) pairs routed to its own experts, skips the others (their local id is
-1), and the same all-reduce sums the ranks: no all-to-all, no all-gather. The shared expert and
the dense layers stay tensor-parallel. A rank copies only its experts' checkpoint tensors, and with
``--enable-ep-weight-filter`` does not read the others' per-expert tensors (`foreign_expert_tensor`).

Quantized experts (`prepare_quantized`): a block whose experts are stored quantized, a GGUF
file's stacked experts in a block type Sonar runs quantized or a quantized safetensors
checkpoint's (GPTQ, AWQ, FP8, compressed-tensors: one quantized module per expert and projection,
the router plain), keeps them quantized: its `FusedExperts` becomes `QuantizedExperts`, one
`QuantLinear` per expert and projection, their packings stacked per projection on the first
forward, and the block runs as one grouped call: on the CPU the native ``sonar_cpu::moe_quant``
(the pairs grouped by expert inside the kernel, each active expert's rows through its tiles, the
weighted sum in float32), on CUDA the Triton grouped GEMM over the packed values; experts that
cannot be stacked run the per-expert loop (`QuantizedExperts.per_expert`). Split over ranks
(`shard_quantized`) as the dense experts are: under tensor parallelism each rank holds its slice
of every expert (gate and up rows, down's input columns in whole quant groups: a slice across a
group is refused by name), under expert parallelism its own experts whole, renumbered to its local
indices; ``--enable-eplb`` (which moves dense expert weights between ranks) is refused with them.

Not served (each a `ModelLoadError` or `LoRAError` naming the family): LoRA adapters, EAGLE heads,
the native fused decode loop (these layers are not the ones it computes; `sonar.models.fused`
skips them).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from sonar.kernels import native, ops
from sonar.kernels.moe import activation, fused_experts, route
from sonar.kernels.quant import QuantizationError, QuantizedWeight, stack_rows
from sonar.kernels.quant_cpu import ACTIVATION_DTYPES, FORMAT_CODES
from sonar.kernels.quant_linear import QuantLinear, QuantMeta
from sonar.kernels.quant_triton import scales_of
from sonar.log import get_logger
from sonar.models.decoder import EAGLE, LORA, MLP, DecoderForCausalLM, DecoderVariant, MissingLayer
from sonar.models.eplb import ExpertMap
from sonar.models.errors import ModelLoadError
from sonar.models.parallel import Shard, TensorParallel

log = get_logger("sonar.moe")


def _triton_parts(packed: dict[str, Tensor]) -> dict[str, Tensor | None]:
    """A projection's stacked Triton packing as `PackedExperts`' tensors."""
    return {"values": packed["qweight"], "scales": scales_of(packed), "offsets": packed.get("offsets")}


@dataclass(frozen=True)
class MoeSpec:
    """A family's sparse block, from its config."""

    num_experts: int
    top_k: int
    intermediate: int
    """Each expert's intermediate size (all ranks together)."""
    renormalize: bool
    shared_intermediate: int | None = None
    """The shared expert's intermediate size; None: no shared expert."""


class GatedMLP(nn.Module):
    """A gated SiLU MLP over this rank's slice of `intermediate`, without the all-reduce (the shared
    expert: its block reduces once for both)."""

    def __init__(self, hidden: int, intermediate: int, parallel: TensorParallel) -> None:
        super().__init__()
        self.intermediate = parallel.split(intermediate, "shared expert's intermediate size")
        self.gate_up_proj = nn.Linear(hidden, 2 * self.intermediate, bias=False)
        self.down_proj = nn.Linear(self.intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class FusedExperts(nn.Module):
    """The experts' weights, stacked: ``gate_up_proj`` ``[E, 2 I, h]`` (each expert's gate rows then
    its up rows), ``down_proj`` ``[E, h, I]``, I this rank's slice."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate = intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate), requires_grad=False)


class ExpertMLP(nn.Module):
    """One expert's projections as linear layers (``gate_up_proj`` ``[2 I, h]``, ``down_proj``
    ``[h, I]``): the places `sonar.models.quantized.install_quantized` puts its `QuantLinear`s."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)


#: The backends whose packings of a block's experts stack into one grouped operator, with the
#: packed tensors each one stacks (those of them a layer has).
GROUPED_BACKENDS = {"native": ("packed",), "triton": ("qweight", "scales", "exponents", "offsets")}


@dataclass(frozen=True)
class StackedExperts:
    """A block's packed expert weights as its grouped operator reads them: per projection each
    packed tensor of the experts' layers stacked on a new first dimension, by name (``native``:
    ``packed`` ``[E, tiles, groups, bytes]`` for ``sonar_cpu::moe_quant``; ``triton``: ``qweight``
    ``[E, K or K / 2, N]`` and ``scales`` / ``exponents`` / ``offsets`` ``[E, K / group, N]`` for
    `sonar.kernels.triton.fused_moe`), and the format they share."""

    backend: str
    gate_up: dict[str, Tensor]
    down: dict[str, Tensor]
    gate_up_meta: QuantMeta
    down_meta: QuantMeta

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for part in (self.gate_up, self.down) for t in part.values())


class QuantizedExperts(nn.ModuleList):
    """The experts of a block as quantized layers, one `ExpertMLP` per (local) expert; computes
    what `sonar.kernels.moe.fused_experts_reference` states.

    One grouped call computes the block where its experts' layers share a backend that has one
    (`GROUPED_BACKENDS`): their packings stacked per projection (`stacked`, made on the first
    forward; each expert's layer then views its slice, so the bytes are held once). On the CPU,
    the native kernels' ``torch.ops.sonar_cpu.moe_quant``: the pairs grouped by expert inside the
    kernel, each active expert's rows through its tiles, the weighted sum in float32. Each
    projection runs the tiles ``linear_quant`` runs for the activations' dtype on the path the CPU
    takes (`sonar.kernels.native.quant_isa`: AVX-512 with int8 activations for int8 experts,
    AVX2, portable), so on one thread the block's output is `per_expert`'s bit for bit but for
    GPT-OSS's sigmoid (the last bit). On CUDA, the Triton grouped GEMM
    (`sonar.kernels.triton.fused_moe`, the unquantized experts' kernel reading the packed values
    and scales): the pairs sorted by expert on the device, one launch per projection, no host
    sync; the same products as `per_expert` up to float rounding. Experts whose packings cannot be
    stacked (formats or groups that differ between experts of a block, an act-order permutation,
    FP8 packed for ``torch._scaled_mm``, the reference backend) run the per-expert path
    (`per_expert`: each active expert's rows through its own `QuantLinear`s, one kernel call per
    expert and projection), as do float16 activations on the CPU and machines without the native
    kernels.

    GPT-OSS's experts (`swiglu_limit` set) also have biases, ``gate_up_proj_bias`` ``[E, 2 I]`` and
    ``down_proj_bias`` ``[E, h]`` (real tensors on `bias_device` in `bias_dtype`, for the
    checkpoint to fill), added after each product, and the clamped SwiGLU in place of silu-and-mul.
    """

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        *,
        swiglu_limit: float | None = None,
        swiglu_alpha: float = 1.702,
        bias_device: torch.device | None = None,
        bias_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(ExpertMLP(hidden, intermediate) for _ in range(num_experts))
        self.num_experts = num_experts
        self.intermediate = intermediate
        self.swiglu_limit = swiglu_limit
        self.swiglu_alpha = swiglu_alpha
        self.gate_up_proj_bias: nn.Parameter | None = None
        self.down_proj_bias: nn.Parameter | None = None
        if swiglu_limit is not None:

            def bias(*shape: int) -> nn.Parameter:
                return nn.Parameter(torch.empty(*shape, device=bias_device, dtype=bias_dtype), requires_grad=False)

            self.gate_up_proj_bias = bias(num_experts, 2 * intermediate)
            self.down_proj_bias = bias(num_experts, hidden)
        self._stacked: StackedExperts | None = None
        self._unstackable: str | None = None

    untraced = True
    """`sonar.engine.compile` runs this forward outside the trace: which experts run depends on the
    routing, a graph break, not a trace. (It applies ``torch.compiler.disable`` there because the
    decorator imports ``torch._dynamo``: seconds at every worker's start, compiled or not.)"""

    def forward(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        """``x`` ``[n, h]`` through the experts `ids` ``[n, top_k]`` chose (-1: another rank's),
        weighted by `weights`; the weighted sum in float32, rounded once to ``x``'s dtype."""
        stacked = self.stacked()
        if stacked is None or (stacked.backend == "native" and x.dtype not in ACTIVATION_DTYPES):
            return self.per_expert(x, weights, ids)
        up, down = stacked.gate_up_meta, stacked.down_meta
        if stacked.backend == "triton":
            from sonar.kernels.triton import fused_moe  # here: importing this module never imports Triton

            return fused_moe.fused_experts(
                x,
                weights,
                ids,
                fused_moe.PackedExperts(up.format, up.group, up.in_features, **_triton_parts(stacked.gate_up)),
                fused_moe.PackedExperts(down.format, down.group, down.in_features, **_triton_parts(stacked.down)),
                self.gate_up_proj_bias,
                self.down_proj_bias,
                self.swiglu_limit,
                self.swiglu_alpha,
            )
        return torch.ops.sonar_cpu.moe_quant(
            x.contiguous(),
            weights.float().contiguous(),
            ids.long().contiguous(),
            stacked.gate_up["packed"],
            FORMAT_CODES[up.format],
            up.group,
            up.has_offsets,
            stacked.down["packed"],
            FORMAT_CODES[down.format],
            down.group,
            down.has_offsets,
            self._bias(self.gate_up_proj_bias, x.dtype),
            self._bias(self.down_proj_bias, x.dtype),
            self.swiglu_limit,
            self.swiglu_alpha,
        )

    @staticmethod
    def _bias(bias: Tensor | None, dtype: torch.dtype) -> Tensor | None:
        """A bias as the kernel takes it: x's dtype or float32 (the model's dtype: as it is)."""
        if bias is None or bias.dtype in (dtype, torch.float32):
            return bias
        return bias.float()

    @property
    def is_stacked(self) -> bool:
        """Whether the experts' packings are stacked: a grouped operator serves the block."""
        return self._stacked is not None

    def stacked(self) -> StackedExperts | None:
        """The experts' packings stacked for their backend's grouped operator (None: the
        per-expert path serves this block, a warning saying why where the cause is the
        checkpoint's)."""
        if self._stacked is None and self._unstackable is None:
            self._stack()
        if self._stacked is not None and self._stacked.backend == "native" and not native.available():
            return None
        return self._stacked

    def _stack(self) -> None:
        layers = [[expert.gate_up_proj for expert in self], [expert.down_proj for expert in self]]
        quantized = [q for projection in layers for q in projection if isinstance(q, QuantLinear)]
        backends = {q.backend.name for q in quantized}
        if len(quantized) < 2 * self.num_experts or len(backends) != 1 or next(iter(backends)) not in GROUPED_BACKENDS:
            self._unstackable = "not every expert is a quantized layer of one backend with a grouped operator"
            return
        backend = next(iter(backends))
        reason = None
        for projection in layers:
            metas = {q.meta for q in projection}
            if len(metas) > 1:
                kinds = sorted(f"{m.format} in groups of {m.group}{' with offsets' * m.has_offsets}" for m in metas)
                reason = f"the experts' packings differ within a projection ({', '.join(kinds)})"
            elif next(iter(metas)).has_perm:
                reason = "an act-order permutation"
            elif "fp8_weight" in projection[0].packed_names:
                reason = "FP8 experts packed for torch._scaled_mm"
        if reason is not None:
            self._unstackable = reason
            log.warning("moe.per_expert_kernels", reason=reason, experts=self.num_experts)
            return
        parts = []
        for projection in layers:
            stacked = {}
            for name in GROUPED_BACKENDS[backend]:
                if name not in projection[0].packed_names:
                    continue
                whole = torch.stack([q.packed[name] for q in projection])
                for q, part in zip(projection, whole, strict=True):
                    setattr(q, f"q_{name}", part)  # the layer keeps working, on its slice of the stacked bytes
                stacked[name] = whole
            parts.append(stacked)
        self._stacked = StackedExperts(backend, parts[0], parts[1], layers[0][0].meta, layers[1][0].meta)

    def per_expert(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        """`forward` as a loop over the active experts, each through its own `QuantLinear`s (the
        reference of ``moe_quant``, and the path where it does not run)."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat[flat >= 0], minlength=self.num_experts).tolist()  # one host sync
        start = int((flat < 0).sum())
        top_k = ids.shape[1]
        for e, count in enumerate(counts):
            if count == 0:
                continue
            pairs = order[start : start + count]
            start += count
            token = pairs // top_k
            expert = self[e]
            out.index_add_(
                0, token, self._expert(e, expert, x[token]).float() * weights.reshape(-1)[pairs, None].float()
            )
        return out.to(x.dtype)

    def _expert(self, e: int, expert: nn.Module, rows: Tensor) -> Tensor:
        if self.swiglu_limit is None:
            return expert.down_proj(ops.silu_and_mul(expert.gate_up_proj(rows)))
        assert self.gate_up_proj_bias is not None and self.down_proj_bias is not None
        gate_up = expert.gate_up_proj(rows) + self.gate_up_proj_bias[e]
        return expert.down_proj(activation(gate_up, self.swiglu_limit, self.swiglu_alpha)) + self.down_proj_bias[e]


def quantized_experts(model: nn.Module) -> list[QuantizedExperts]:
    """The model's blocks of quantized experts."""
    return [m for m in model.modules() if isinstance(m, QuantizedExperts)]


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden: int, spec: MoeSpec, parallel: TensorParallel) -> None:
        super().__init__()
        self.spec = spec
        self.parallel = parallel
        self.expert_parallel = parallel.expert_placement is not None
        if self.expert_parallel:
            self.intermediate = spec.intermediate
        else:
            self.intermediate = parallel.split(spec.intermediate, "MoE intermediate size")
        self.expert_map: ExpertMap | None = None
        """Expert load balancing (`sonar.models.eplb`): the placement that follows the load."""
        if self.expert_parallel and parallel.redundant_experts is not None:
            self.expert_map = ExpertMap(spec.num_experts, spec.num_experts + parallel.redundant_experts, parallel)
            self.local_experts = self.expert_map.local_experts
        else:
            self.local_experts = parallel.local_experts(spec.num_experts)
        """The global ids of the experts this rank holds, in the order they are stacked (under
        EPLB one per slot: an expert may fill several)."""
        self.gate = nn.Linear(hidden, spec.num_experts, bias=False)
        self.experts = FusedExperts(len(self.local_experts), hidden, self.intermediate)
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if spec.shared_intermediate:
            self.shared_expert = GatedMLP(hidden, spec.shared_intermediate, parallel)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        spec = self.spec
        weights, ids = route(self.gate(x), spec.top_k, spec.renormalize)
        out = self.run_experts(x, weights, self.local_ids(ids))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.parallel.all_reduce(out)

    def local_ids(self, ids: Tensor) -> Tensor:
        """The router's global expert `ids` as indices into this rank's stacked experts (-1: another
        rank's), through the EPLB map where there is one."""
        if self.expert_map is not None:
            return self.expert_map.local_ids(ids)
        return self.parallel.local_expert_ids(ids, self.spec.num_experts)

    def run_experts(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        """The routed experts' weighted sum: the fused operator, or the quantized experts."""
        if isinstance(self.experts, QuantizedExperts):
            return self.experts(x, weights, ids)
        return fused_experts(x, weights, ids, self.experts.gate_up_proj, self.experts.down_proj)


_MLP_NAME = re.compile(r"model\.layers\.(\d+)\.mlp\.(.+)")
_EXPERT_PART = re.compile(r"experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_EXPERT_TENSOR = re.compile(r"experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.\w+")
_DENSE_PART = re.compile(r"(shared_expert\.)?(gate_proj|up_proj|down_proj)\.weight")
_QUANTIZED_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)")


class MoeForCausalLM(DecoderForCausalLM):
    """Base of the MoE families: `moe_spec` says what their sparse blocks are, `is_sparse` which
    layers have one (the others keep the dense `MLP` of ``intermediate_size``), `checkpoint_name`
    maps a family's own checkpoint names onto the ones this module uses."""

    refused: ClassVar[dict[str, str]] = {
        LORA: "the adapters' target modules are dense MLPs, and a mixture-of-experts layer has none",
        EAGLE: "the EAGLE heads Sonar loads are built for dense, not mixture-of-experts, targets",
    }

    @classmethod
    def moe_spec(cls, config: Any) -> MoeSpec:
        raise NotImplementedError

    @classmethod
    def is_sparse(cls, config: Any, layer: int) -> bool:
        return True

    @classmethod
    def base_variant(cls, config: Any) -> DecoderVariant:
        return DecoderForCausalLM.make_variant(config)

    @classmethod
    def make_variant(cls, config: Any) -> DecoderVariant:
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"{cls.__name__}: hidden_act {act!r} is not supported (only silu)")
        return replace(cls.base_variant(config), mlp_factory=cls.make_mlp)

    @classmethod
    def make_mlp(cls, config: Any, variant: DecoderVariant, layer: int, parallel: TensorParallel) -> nn.Module:
        if cls.is_sparse(config, layer):
            return SparseMoeBlock(config.hidden_size, cls.moe_spec(config), parallel)
        return MLP(config, variant, parallel)

    def checkpoint_name(self, name: str) -> str:
        return name

    def stacked_params(self) -> dict[str, tuple[str, int, int]]:
        """Only q/k/v: the MLPs' parts differ from layer to layer, `_MlpLoader` places them."""
        attn = self.own_layers[0].self_attn
        q, kv = attn.q_size, attn.kv_size
        return {
            ".q_proj.": (".qkv_proj.", 0, q),
            ".k_proj.": (".qkv_proj.", q, kv),
            ".v_proj.": (".qkv_proj.", q + kv, kv),
        }

    def checkpoint_shard(self, name: str) -> Shard | None:
        found = _MLP_NAME.fullmatch(name)
        if found is None or self.parallel.size == 1:
            return super().checkpoint_shard(name)
        mlp = self.model.layers[int(found[1])].mlp
        part = _DENSE_PART.fullmatch(found[2])
        if part is None:  # the router, the shared expert's gate: replicated; experts: `_MlpLoader`
            return None
        size = mlp.shared_expert.intermediate if part[1] else mlp.intermediate
        first = self.parallel.rank * size
        return Shard(1, first, size) if part[2] == "down_proj" else Shard(0, first, size)

    def foreign_expert_tensor(self, name: str) -> bool:
        """Whether checkpoint tensor `name` is (a part of) one expert's projection that another
        expert-parallel rank holds (``--enable-ep-weight-filter`` leaves it unread): its weight, or
        a quantized checkpoint's ``qweight``, ``scales``, ... Stacked experts: never."""
        found = _MLP_NAME.fullmatch(self.checkpoint_name(name))
        if found is None or int(found[1]) >= len(self.model.layers):
            return False
        expert = _EXPERT_TENSOR.fullmatch(found[2])
        block = getattr(self.model.layers[int(found[1])], "mlp", None)  # None: another stage's layer
        if expert is None or not isinstance(block, SparseMoeBlock) or not block.expert_parallel:
            return False
        e = int(expert[1])
        return e < block.spec.num_experts and e not in block.local_experts

    def shard_quantized(self, weights: dict[str, QuantizedWeight]) -> dict[str, QuantizedWeight]:
        """As every decoder's, the checkpoint's module names first mapped onto this module's
        (`checkpoint_name`: Mixtral's ``block_sparse_moe.experts.E.w1``), and each quantized
        expert projection cut as `_MlpLoader` cuts a dense one (`_expert_shard`)."""
        rest: dict[str, QuantizedWeight] = {}
        experts: dict[str, QuantizedWeight] = {}
        for checkpoint, qw in weights.items():
            name = self.checkpoint_name(f"{checkpoint}.weight").removesuffix(".weight")
            found = _QUANTIZED_EXPERT.fullmatch(name)
            if found is None:
                rest[name] = qw
            elif self.owns(name):
                experts.update(self._expert_shard(found, qw))
        return super().shard_quantized(rest) | experts

    def _expert_shard(self, found: re.Match[str], qw: QuantizedWeight) -> dict[str, QuantizedWeight]:
        """This rank's part of one quantized expert projection (`found`: its name), by the name
        `prepare_quantized` reads: under tensor parallelism the rank's slice of the expert's
        intermediate size (gate and up rows; down's input columns, in whole quant groups), under
        expert parallelism the whole expert, renumbered to its index among the rank's experts, or
        nothing for another rank's."""
        name, layer, e, proj = found[0], int(found[1]), int(found[2]), found[3]
        block = self.model.layers[layer].mlp
        if not isinstance(block, SparseMoeBlock):
            return {name: qw}  # `install_quantized` refuses it by name: a dense layer has no experts
        if block.expert_map is not None:
            raise ModelLoadError(
                f"{type(self).__name__}: quantized experts ({name}) are not moved between ranks by expert load "
                "balancing (--enable-eplb moves dense expert weights); serve it with --dequantize-weights, or "
                "without --enable-eplb"
            )
        if e >= block.spec.num_experts:
            raise ModelLoadError(f"quantized weight {name}: expert {e} of a model of {block.spec.num_experts} experts")
        hidden, whole = block.experts.gate_up_proj.shape[-1], block.spec.intermediate
        expected = (hidden, whole) if proj == "down_proj" else (whole, hidden)
        if (qw.out_features, qw.in_features) != expected:  # before cutting a shard, which pads what is missing
            raise ModelLoadError(
                f"quantized weight {name} is {qw.out_features}x{qw.in_features}, the model expects {expected}"
            )
        if block.expert_parallel:
            if e not in block.local_experts:
                return {}
            return {f"model.layers.{layer}.mlp.experts.{block.local_experts.index(e)}.{proj}": qw}
        if self.parallel.size == 1:
            return {name: qw}
        inter = block.intermediate
        return {name: Shard(1 if proj == "down_proj" else 0, self.parallel.rank * inter, inter).quantized(qw, name)}

    def prepare_quantized(self, weights: dict[str, QuantizedWeight]) -> dict[str, QuantizedWeight]:
        """Before `install_quantized`: gate and up stacked into ``gate_up_proj`` (dense MLPs,
        shared experts, each expert), and each block whose experts are all quantized given a
        `QuantizedExperts` for them (``mlp.experts.E.gate_up_proj`` / ``down_proj``)."""
        out = dict(weights)
        for gate in [name for name in out if name.endswith(".gate_proj")]:
            up = gate.removesuffix("gate_proj") + "up_proj"
            if up in out:
                try:
                    out[gate.removesuffix("gate_proj") + "gate_up_proj"] = stack_rows([out.pop(gate), out.pop(up)])
                except QuantizationError as exc:
                    raise ModelLoadError(f"{gate} and {up} cannot be served as one quantized matrix: {exc}") from exc
        for i, layer in enumerate(self.model.layers):
            block = getattr(layer, "mlp", None)
            prefix = f"model.layers.{i}.mlp.experts"
            if not isinstance(block, SparseMoeBlock) or not any(n.startswith(f"{prefix}.") for n in out):
                continue
            experts = block.experts.num_experts
            wanted = [f"{prefix}.{e}.{p}" for e in range(experts) for p in ("gate_up_proj", "down_proj")]
            lacking = [name for name in wanted if name not in out]
            if lacking:
                raise ModelLoadError(
                    f"{type(self).__name__}: some of {prefix}'s projections are stored in a block type Sonar serves "
                    f"quantized and some not ({lacking[0]} is not); serve it with --dequantize-weights"
                )
            hidden = block.experts.gate_up_proj.shape[-1]
            with torch.device("meta"):  # places for the quantized layers, which bring their own tensors
                block.experts = QuantizedExperts(experts, hidden, block.experts.intermediate)
        return out

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        loader = _MlpLoader(self)
        rest = ((n, t) for n, t in ((self.checkpoint_name(n), t) for n, t in weights) if not loader.take(n, t))
        return super().load_weights(rest) | loader.complete()


class _MlpLoader:
    """Places a MoE model's MLP tensors (dense, shared expert, router, experts in either layout)
    into their parameters, cut to this rank's shard, and tells which parameters are complete."""

    def __init__(self, model: MoeForCausalLM) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.parts: dict[str, set[tuple[int, str]]] = {}
        self.local: dict[str, dict[int, list[int]]] = {}

    def take(self, name: str, tensor: Tensor) -> bool:
        """Whether `name` is an MLP tensor (placed, or skipped: another stage's layer)."""
        found = _MLP_NAME.fullmatch(name)
        if found is None:
            return False
        prefix, rest = f"model.layers.{found[1]}.mlp", found[2]
        if isinstance(self.model.model.layers[int(found[1])], MissingLayer):
            return True  # a layer of another pipeline stage
        expert = _EXPERT_PART.fullmatch(rest)
        if expert is not None:
            self._expert(prefix, int(expert[1]), expert[2], tensor, name)
        elif rest in ("experts.gate_up_proj", "experts.down_proj"):
            self._stacked(prefix, rest, tensor, name)
        else:
            self._dense(prefix, rest, tensor, name)
        return True

    def _copy(self, param: str, dest: Tensor, tensor: Tensor, name: str, part: tuple[int, str]) -> None:
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ModelLoadError(
                f"weight {name} has shape {tuple(tensor.shape)}, the model expects {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
        self.parts.setdefault(param, set()).add(part)

    def _param(self, name: str, checkpoint_name: str) -> Tensor:
        param = self.params.get(name)
        if param is None:
            raise ModelLoadError(f"{type(self.model).__name__} has no place for weight {checkpoint_name}")
        return param.data

    def _expert(self, prefix: str, e: int, proj: str, tensor: Tensor, name: str) -> None:
        block = self.model.get_submodule(prefix)
        if not isinstance(block, SparseMoeBlock):
            raise ModelLoadError(f"{type(self.model).__name__} has no place for weight {name} (a dense layer)")
        local = self._local(prefix, block)
        if e not in local:
            if e >= block.spec.num_experts:
                raise ModelLoadError(f"weight {name}: expert {e} of a model of {block.spec.num_experts} experts")
            return  # another expert-parallel rank's expert
        hidden, whole = block.experts.gate_up_proj.shape[-1], block.spec.intermediate
        expected = (hidden, whole) if proj == "down_proj" else (whole, hidden)
        if tuple(tensor.shape) != expected:  # before cutting a shard, which pads what is missing
            raise ModelLoadError(f"weight {name} has shape {tuple(tensor.shape)}, the model expects {expected}")
        inter = block.experts.intermediate
        # expert parallelism keeps whole experts; tensor parallelism this rank's slice of each
        first_row = 0 if block.expert_parallel else self.model.parallel.rank * inter
        for slot in local[e]:  # under EPLB an expert may fill several slots
            if proj == "down_proj":
                param = f"{prefix}.experts.down_proj"
                dest = self._param(param, name)[slot]
                self._copy(param, dest, Shard(1, first_row, inter).tensor(tensor), name, (slot, proj))
                continue
            param = f"{prefix}.experts.gate_up_proj"
            first = 0 if proj == "gate_proj" else inter
            dest = self._param(param, name)[slot].narrow(0, first, inter)
            self._copy(param, dest, Shard(0, first_row, inter).tensor(tensor), name, (slot, proj))

    def _local(self, prefix: str, block: SparseMoeBlock) -> dict[int, list[int]]:
        """A sparse block's global expert id -> its indices in the stacked weights, this rank's only."""
        if prefix not in self.local:
            slots: dict[int, list[int]] = {}
            for i, e in enumerate(block.local_experts):
                slots.setdefault(e, []).append(i)
            self.local[prefix] = slots
        return self.local[prefix]

    def _stacked(self, prefix: str, rest: str, tensor: Tensor, name: str) -> None:
        """Experts stacked as transformers keeps them: split into per-expert parts."""
        experts = tensor.shape[0]
        if rest == "experts.down_proj":
            for e in range(experts):
                self._expert(prefix, e, "down_proj", tensor[e], name)
            return
        half = tensor.shape[1] // 2
        for e in range(experts):
            self._expert(prefix, e, "gate_proj", tensor[e, :half], name)
            self._expert(prefix, e, "up_proj", tensor[e, half:], name)

    def _dense(self, prefix: str, rest: str, tensor: Tensor, name: str) -> None:
        tensor = self.model.shard_checkpoint(name, tensor)
        part = _DENSE_PART.fullmatch(rest)
        if part is None or part[2] == "down_proj":  # router, shared expert gate, down projections
            param = f"{prefix}.{rest}" if part is None else f"{prefix}.{part[1] or ''}down_proj.weight"
            self._copy(param, self._param(param, name), tensor, name, (0, "whole"))
            return
        param = f"{prefix}.{part[1] or ''}gate_up_proj.weight"
        dest = self._param(param, name)
        rows = dest.shape[0] // 2
        self._copy(param, dest.narrow(0, 0 if part[2] == "gate_proj" else rows, rows), tensor, name, (0, part[2]))

    def complete(self) -> set[str]:
        """The MLP parameters every part of which was written."""
        done = set()
        for param, parts in self.parts.items():
            if param.endswith(".experts.gate_up_proj"):
                needed = 2 * self.params[param].shape[0]
            elif param.endswith(".experts.down_proj"):
                needed = self.params[param].shape[0]
            elif param.endswith("gate_up_proj.weight"):
                needed = 2
            else:
                needed = 1
            if len(parts) == needed:
                done.add(param)
        return done
