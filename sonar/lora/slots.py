"""The worker's adapter table: ``--max-loras`` slots in the model's `LoRALinear` layers, and an LRU
of adapters read from disk kept in host memory (``--max-cpu-loras``).

The scheduler lets no step use more adapters than there are slots, so `activate` can always give
each adapter of a step a slot: one it already has, a free one, or the one used least recently by
earlier steps. An adapter that lost its slot comes back from the host LRU (a copy) or, evicted from
there too, from its folder (a read, checked against its digest: a folder rewritten since the
adapter was loaded is refused, never served under the old identity).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import torch
from torch import nn

from sonar.core.request import LoRARequest
from sonar.errors import LoRAError
from sonar.log import get_logger
from sonar.lora.adapter import LoRAWeights, read_adapter
from sonar.lora.limits import FUSED, MODULES, LoRALimits, ModelShapes
from sonar.models.lora import ColumnShardedLoRALinear, LoRAContext, LoRALinear, RowShardedLoRALinear
from sonar.models.parallel import TensorParallel

log = get_logger("sonar.lora")


class AdapterSlots:
    """Wraps the targeted linears of `model` (a `DecoderForCausalLM`) in `LoRALinear` layers and
    manages what their slots hold."""

    def __init__(
        self,
        model: nn.Module,
        *,
        max_loras: int,
        max_cpu_loras: int,
        limits: LoRALimits,
        shapes: ModelShapes,
        dtype: torch.dtype,
        device: torch.device,
        fully_sharded: bool = False,
    ) -> None:
        refused = getattr(model, "refuses", {}).get("lora")
        if refused:
            raise LoRAError(refused)
        self.model = model
        self.limits = limits
        self.shapes = shapes
        self.max_cpu_loras = max_cpu_loras
        self.context = LoRAContext(device)
        self.linears: list[tuple[int, str, LoRALinear]] = []
        """(layer index, fused layer name, its wrapper) for every wrapped linear."""
        owned = {id(layer): i for i, layer in enumerate(model.model.layers)}
        for layer in model.own_layers:
            index = owned[id(layer)]
            for fused, (parent_name, modules) in FUSED.items():
                if not any(limits.targets(m) for m in modules):
                    continue
                parent = getattr(layer, parent_name)
                args = (getattr(parent, fused), *_splits(layer, fused), max_loras, limits.max_rank, dtype, self.context)
                wrapper = _wrapper(model.parallel, fused, args) if fully_sharded else LoRALinear(*args)
                setattr(parent, fused, wrapper)
                self.linears.append((index, fused, wrapper))
        self.slots: list[str | None] = [None] * max_loras
        """The digest of the adapter each slot holds."""
        self._last_used = [0] * max_loras
        self._clock = 0
        self.host: OrderedDict[str, LoRAWeights] = OrderedDict()

    def activate(self, adapters: Iterable[LoRARequest]) -> tuple[dict[str, int], dict[str, LoRAError]]:
        """A slot for each adapter (by digest) of the next step, loading those without one, and
        why each adapter that could not be loaded was not (its folder gone or rewritten). Raises
        ValueError when the step has more adapters than slots (the scheduler never sends one)."""
        wanted = {a.digest: a for a in adapters}
        if len(wanted) > len(self.slots):
            raise ValueError(f"a step uses {len(wanted)} LoRA adapters; --max-loras is {len(self.slots)}")
        self._clock += 1
        where = {digest: i for i, digest in enumerate(self.slots) if digest in wanted}
        failed: dict[str, LoRAError] = {}
        for digest, adapter in wanted.items():
            if digest not in where:
                try:
                    weights = self._weights(adapter)
                except LoRAError as exc:
                    failed[digest] = exc
                    continue
                free = [i for i in range(len(self.slots)) if self.slots[i] not in wanted]
                slot = min(free, key=lambda i: (self.slots[i] is not None, self._last_used[i]))
                self._write(slot, weights)
                where[digest] = slot
            self._last_used[where[digest]] = self._clock
        return where, failed

    def _weights(self, adapter: LoRARequest) -> LoRAWeights:
        weights = self.host.get(adapter.digest)
        if weights is not None:
            self.host.move_to_end(adapter.digest)
            return weights
        weights = read_adapter(adapter.path, self.shapes, self.limits)
        if weights.digest != adapter.digest:
            raise LoRAError(
                f"LoRA adapter {adapter.name!r}: the files in {adapter.path} changed since it was loaded "
                "(their digest differs); load it again to serve the new files"
            )
        self.host[adapter.digest] = weights
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
        log.info("lora.read", adapter=adapter.name, path=adapter.path, rank=weights.rank)
        return weights

    def _write(self, slot: int, weights: LoRAWeights) -> None:
        """Copy `weights` into `slot` of every wrapped linear (this rank's share of each)."""
        rank = self.limits.max_rank
        for index, fused, linear in self.linears:
            a, b = linear.a[slot], linear.b[slot]
            a.zero_()
            b.zero_()
            offset = 0
            for j, module in enumerate(FUSED[fused][1]):
                pair = weights.factors.get((index, module))
                if pair is not None:
                    down = torch.zeros(rank, pair[0].shape[1])  # padded to the slots' rank
                    up = torch.zeros(pair[1].shape[0], rank)
                    down[: pair[0].shape[0]] = pair[0]
                    up[:, : pair[1].shape[1]] = pair[1]
                    down, up = self._shard(index, module, linear, down, up)
                    a[j * linear.a_rank : (j + 1) * linear.a_rank].copy_(down)
                    b[offset : offset + up.shape[0]].copy_(up)
                offset += linear.splits[j]
        self.slots[slot] = weights.digest

    def _shard(
        self, layer: int, module: str, linear: LoRALinear, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This tensor-parallel rank's part of a module's (padded) factors: the rows of B its base
        layer's output columns hold (column-parallel), or the columns of A its input holds
        (row-parallel, whose partial deltas the layer's all-reduce sums with the base output).
        Fully sharded, also its slice of A's rank (column-parallel) or of B's rows (row-parallel)."""
        parent = FUSED[MODULES[module]][0]
        shard = self.model.checkpoint_shard(f"model.layers.{layer}.{parent}.{module}.weight")
        if shard is None:
            return a, b
        tp = self.model.parallel
        if shard.dim == 0:
            b = shard.tensor(b)
            if isinstance(linear, ColumnShardedLoRALinear):
                a = a[tp.rank * linear.a_rank : (tp.rank + 1) * linear.a_rank]
            return a, b
        a = shard.tensor(a)
        if isinstance(linear, RowShardedLoRALinear):
            rows = linear.b.shape[1]
            b = b[tp.rank * rows : (tp.rank + 1) * rows]
        return a, b


def _splits(layer: nn.Module, fused: str) -> tuple[int, tuple[int, ...]]:
    """A fused layer's input size and its sub-projection output sizes, on this rank."""
    attn, mlp = layer.self_attn, layer.mlp
    hidden = layer.input_layernorm.weight.shape[0]
    if fused == "qkv_proj":
        return hidden, (attn.q_size, attn.kv_size, attn.kv_size)
    if fused == "o_proj":
        return attn.q_size, (hidden,)
    if fused == "gate_up_proj":
        return hidden, (mlp.intermediate, mlp.intermediate)
    return mlp.intermediate, (hidden,)


def _wrapper(parallel: TensorParallel, fused: str, args: tuple) -> LoRALinear:
    """``--fully-sharded-loras``: the layer that shards the rest of the LoRA work over the ranks."""
    if parallel.size == 1:
        return LoRALinear(*args)
    rank, hidden = args[4], args[2][0]
    if fused in ("qkv_proj", "gate_up_proj"):
        if rank % parallel.size:
            raise LoRAError(
                f"--fully-sharded-loras: --max-lora-rank {rank} does not split over "
                f"--tensor-parallel-size {parallel.size}"
            )
        return ColumnShardedLoRALinear(*args, a_rank=rank // parallel.size, parallel=parallel)
    if hidden % parallel.size:
        raise LoRAError(
            f"--fully-sharded-loras: the hidden size {hidden} does not split over --tensor-parallel-size {parallel.size}"
        )
    return RowShardedLoRALinear(*args, b_rows=hidden // parallel.size, parallel=parallel)
