"""Expert-parallel load balancing on the ranks (``--enable-eplb``): each MoE layer's logical ->
physical expert map, the count of tokens routed to each expert, and the rebalance that moves
expert weights between the ranks. The decisions are `sonar.core.eplb`'s.

A sparse block under EPLB holds ``(E + num_redundant_experts) / ranks`` expert *slots* (stacked
like the experts of plain expert parallelism), and an `ExpertMap`: for each logical expert the
physical slots of its replicas. The router's ids become physical ones there — the ``i``-th routed
pair of a step goes to replica ``i mod replicas`` of its expert, on every rank alike — then local
ones, ``-1`` for the slots other ranks hold; the fused operator and the all-reduce that ends the
layer are those of expert parallelism, so each pair is computed exactly once, by one replica.

The same map counts each logical expert's routed pairs into a device tensor (an ``index_add_``,
no host sync, captured by CUDA graphs like the rest of the layer). `ExpertBalancer`, the worker's,
moves those counts into a sliding window of `window_size` steps after each step and, every
`step_interval` steps, before the next step's forward pass (every rank of the group runs the same
steps, so all of them rebalance between the same two): takes rank 0's window (broadcast, so the
ranks agree on the numbers), plans each layer's placement (`sonar.core.eplb.rebalance`), and
moves the expert weights that change rank with torch.distributed point-to-point over the
tensor-parallel group, a layer at a time; slots that keep their expert are not touched.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from sonar.core import eplb
from sonar.log import get_logger
from sonar.models.parallel import ParallelLayoutError, TensorParallel

log = get_logger("sonar.eplb")


class ExpertMap(nn.Module):
    """One sparse block's placement under EPLB: `placement` (slot -> logical expert, every rank's
    slots) on the host, and its device form: `physical` ``[E, max replicas]`` (each expert's slots,
    padded with its first), `replicas` ``[E]``, and `load` ``[E]``, the pairs routed this step."""

    def __init__(self, num_experts: int, num_slots: int, parallel: TensorParallel) -> None:
        super().__init__()
        if num_slots % parallel.size:
            raise ParallelLayoutError(
                f"--enable-eplb over {parallel.size} ranks needs the model's experts plus num_redundant_experts "
                f"({num_experts} + {num_slots - num_experts}) to be a multiple of {parallel.size}"
            )
        self.num_experts = num_experts
        self.ranks = parallel.size
        self.per_rank = num_slots // parallel.size
        self.first = parallel.rank * self.per_rank
        self.placement = eplb.initial_placement(num_experts, num_slots, parallel.size, parallel.expert_placement or "")
        most = num_slots - num_experts + 1
        self.register_buffer("physical", torch.zeros(num_experts, most, dtype=torch.long), persistent=False)
        self.register_buffer("replicas", torch.ones(num_experts, dtype=torch.long), persistent=False)
        self.register_buffer("load", torch.zeros(num_experts, dtype=torch.long), persistent=False)
        self._write()

    @property
    def local_experts(self) -> list[int]:
        """The logical expert of each of this rank's slots."""
        return self.placement[self.first : self.first + self.per_rank]

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # `load_model` builds on the meta device and then calls `to_empty`: the map's tensors
        # come back uninitialised, so they are written again from the host placement
        super()._apply(fn, recurse)
        self._write()
        return self

    def _write(self) -> None:
        if self.physical.is_meta:
            return
        slots: list[list[int]] = [[] for _ in range(self.num_experts)]
        for p, e in enumerate(self.placement):
            slots[e].append(p)
        table = [s + [s[0]] * (self.physical.shape[1] - len(s)) for s in slots]
        self.physical.copy_(torch.tensor(table, dtype=torch.long))
        self.replicas.copy_(torch.tensor([len(s) for s in slots], dtype=torch.long))
        self.load.zero_()

    def set_placement(self, placement: list[int]) -> None:
        self.placement = list(placement)
        self._write()

    def local_ids(self, ids: Tensor) -> Tensor:
        """The router's logical `ids` ``[n, top_k]`` as this rank's slot indices (-1: another
        rank's), each pair dealt to one replica of its expert; counts the pairs into `load`."""
        flat = ids.reshape(-1)
        self.load.index_add_(0, flat, torch.ones_like(flat))
        pick = torch.arange(flat.numel(), device=ids.device) % self.replicas.index_select(0, flat)
        slot = self.physical.view(-1).index_select(0, flat * self.physical.shape[1] + pick)
        local = slot - self.first
        return torch.where((local >= 0) & (local < self.per_rank), local, -1).reshape(ids.shape)


@dataclass(frozen=True)
class Rebalance:
    """What one rebalance did (kept on the balancer, logged as ``eplb.rebalanced``)."""

    step: int
    layers_changed: int
    experts_moved: int
    """Slots, over all ranks and layers, whose expert came from another rank."""
    balancedness_before: float
    balancedness_after: float
    """Both of the same window's load: under the old placements and under the new."""
    seconds: float


class ExpertBalancer:
    """The worker's side of EPLB over `blocks` (name -> a sparse block with an `ExpertMap`)."""

    def __init__(
        self, blocks: dict[str, nn.Module], config: eplb.EplbConfig, parallel: TensorParallel, num_nodes: int = 1
    ) -> None:
        self.blocks = blocks
        self.config = config
        self.parallel = parallel
        self.num_nodes = num_nodes
        """Machines the group's ranks are spread over, in order: with DeepSeek's expert groups
        (``n_group``) the hierarchical policy keeps whole groups on a node."""
        self.maps: list[ExpertMap] = [block.expert_map for block in blocks.values()]  # type: ignore[misc]
        device = self.maps[0].load.device
        self.window = torch.zeros(
            config.window_size, len(self.maps), self.maps[0].num_experts, dtype=torch.long, device=device
        )
        """Each step's routed pairs per layer and logical expert, ``[window_size, layers, E]``, a ring."""
        self.steps = 0
        self._rebalanced_at = 0
        self.history: list[Rebalance] = []
        for m in self.maps:
            m.load.zero_()  # what warm-up and profiling routed is not load

    @property
    def due(self) -> bool:
        """Whether the next step's forward pass waits for a rebalance."""
        steps = self.steps
        return steps > 0 and steps % self.config.step_interval == 0 and steps != self._rebalanced_at

    def step_done(self) -> None:
        """After a step's forward pass: its counts into the window (device ops only, unless the
        balancedness is logged this step)."""
        loads = [m.load for m in self.maps]
        torch.stack(loads, out=self.window[self.steps % self.config.window_size])
        torch._foreach_zero_(loads)
        self.steps += 1
        cfg = self.config
        if cfg.log_balancedness and self.parallel.leader and self.steps % cfg.log_balancedness_interval == 0:
            step = self.window[(self.steps - 1) % cfg.window_size].tolist()
            value = eplb.balancedness([m.placement for m in self.maps], step, self.parallel.size)
            log.info("eplb.balancedness", step=self.steps, balancedness=round(value, 4))

    def rebalance(self) -> Rebalance:
        """Plan every layer's placement from the window and move the weights (a collective: every
        rank of the group calls it between the same two steps)."""
        started = time.perf_counter()
        self._rebalanced_at = self.steps
        load = self.window.sum(0)
        if self.parallel.size > 1:  # the ranks' counts are the same routing; rank 0's are the ones used
            dist.broadcast(load, group=self.parallel.group, group_src=0)
        loads = load.tolist()
        before = [list(m.placement) for m in self.maps]
        after = [
            eplb.rebalance(
                layer,
                len(old),
                self.parallel.size,
                previous=old,
                num_groups=getattr(block, "num_groups", 1),  # DeepSeek's expert groups (n_group)
                num_nodes=self.num_nodes,
            )
            for layer, old, block in zip(loads, before, self.blocks.values())
        ]
        moved = 0
        for block, old, new in zip(self.blocks.values(), before, after):
            if new != old:
                moved += self._move(block, old, new)
                block.expert_map.set_placement(new)
                block.local_experts = block.expert_map.local_experts
        done = Rebalance(
            step=self.steps,
            layers_changed=sum(old != new for old, new in zip(before, after)),
            experts_moved=moved,
            balancedness_before=eplb.balancedness(before, loads, self.parallel.size),
            balancedness_after=eplb.balancedness(after, loads, self.parallel.size),
            seconds=time.perf_counter() - started,
        )
        self.history.append(done)
        if self.parallel.leader:
            log.info(
                "eplb.rebalanced",
                step=done.step,
                layers_changed=done.layers_changed,
                experts_moved=done.experts_moved,
                balancedness_before=round(done.balancedness_before, 4),
                balancedness_after=round(done.balancedness_after, 4),
                seconds=round(done.seconds, 3),
            )
        return done

    def _move(self, block: nn.Module, old: list[int], new: list[int]) -> int:
        """Give this rank's slots their experts of `new`: kept where they are, copied from another
        of its slots, or received from the first rank that held the expert; send what the others
        need from this rank. Returns the slots (over all ranks) whose expert came from elsewhere."""
        per_rank, me = len(old) // self.parallel.size, self.parallel.rank
        params = (block.experts.gate_up_proj, block.experts.down_proj)
        incoming: dict[int, list[Tensor]] = {}
        ops: list[dist.P2POp] = []
        moved = 0
        for p, e in enumerate(new):
            if old[p] == e:
                continue
            rank, slot = divmod(p, per_rank)
            mine = old[rank * per_rank : (rank + 1) * per_rank]
            if e in mine:  # another slot of the same rank has it
                if rank == me:
                    incoming[slot] = [w[mine.index(e)].clone() for w in params]
                continue
            moved += 1
            source = old.index(e)
            src_rank, src_slot = divmod(source, per_rank)
            for i, w in enumerate(params):
                tag = 2 * p + i
                if rank == me:
                    buf = torch.empty_like(w[slot])
                    incoming.setdefault(slot, []).append(buf)
                    ops.append(dist.P2POp(dist.irecv, buf, group=self.parallel.group, group_peer=src_rank, tag=tag))
                elif src_rank == me:
                    ops.append(dist.P2POp(dist.isend, w[src_slot], group=self.parallel.group, group_peer=rank, tag=tag))
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        for slot, tensors in incoming.items():
            for w, t in zip(params, tensors):
                w[slot].copy_(t)
        return moved
