"""Expert-parallel load balancing (``--enable-eplb``, ``--eplb-config``): where each MoE layer's
experts go, decided from the load the router gave them, as plain values.

With expert parallelism every MoE layer has ``P = E + num_redundant_experts`` *physical* expert
slots, ``P / ranks`` on each rank (rank ``r`` holds slots ``r * P / ranks`` onward); a layer's
placement is the list of the logical expert in each slot. Every logical expert has at least one
slot, the hottest have more (replicas), and each routed (token, expert) pair is computed by one of
its expert's replicas, so a rank's work is the load of the slots it holds.

`rebalance` is DeepSeek's EPLB algorithm (the reference server's ``default`` policy):

1. hierarchical, when the experts form ``num_groups`` groups (DeepSeek's group-limited routing) and
   the groups divide over ``num_nodes``: pack whole groups onto nodes, balancing their load, so a
   token's experts stay on few nodes; otherwise one node holds every group (the global policy);
2. on each node, give the redundant slots one at a time to the expert whose load per replica is
   the highest (`replicate`);
3. pack the node's replicas (each carrying its expert's load divided by its replica count) onto the
   node's ranks, heaviest first into the lightest rank that has a slot free (`pack`): equal slot
   counts per rank, balanced load.

Finally each rank's new experts are laid into its slots so that an expert a rank already holds
keeps its slot, and packs go to the ranks that already hold most of their experts: the weights
that move between ranks are only those the new placement needs (`keep_slots`).

`balancedness` is the reference's measure: the mean of the ranks' loads over the largest (1.0
perfectly balanced; summed over layers before dividing).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

POLICIES = ("default",)


class EplbConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``--eplb-config``: the reference's fields and defaults, except `use_async` (see there)."""

    window_size: int = 1000
    """Steps of routed-token counts a rebalance looks at (a sliding window)."""
    step_interval: int = 3000
    """Steps between rebalances."""
    num_redundant_experts: int = 0
    """Extra slots per MoE layer (over all ranks) holding replicas of the hottest experts."""
    log_balancedness: bool = False
    """Log the ranks' balancedness (`balancedness`) every `log_balancedness_interval` steps."""
    log_balancedness_interval: int = 1
    use_async: bool = False
    """Sonar moves the expert weights between two steps, synchronously; moving them in the
    background while steps run (the reference's default, true) is refused by name."""
    policy: str = "default"
    communicator: str | None = None
    """None: torch.distributed point-to-point over the tensor-parallel group (the one Sonar has)."""

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> EplbConfig:
        """The config of ``--eplb-config`` (``{}``: the defaults); ValueError naming a bad field."""
        try:
            config = msgspec.convert(dict(raw), cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"--eplb-config: {exc}") from None
        for name in ("window_size", "step_interval", "log_balancedness_interval"):
            if getattr(config, name) < 1:
                raise ValueError(f"--eplb-config: {name} must be at least 1, got {getattr(config, name)}")
        if config.num_redundant_experts < 0:
            raise ValueError(
                f"--eplb-config: num_redundant_experts must be 0 or more, got {config.num_redundant_experts}"
            )
        if config.use_async:
            raise ValueError(
                "--eplb-config: use_async true is not supported: Sonar moves the expert weights between two "
                "steps, synchronously (set use_async false)"
            )
        if config.policy not in POLICIES:
            raise ValueError(
                f"--eplb-config: policy {config.policy!r} is not supported; Sonar's policy is 'default' "
                "(DeepSeek's hierarchical or global packing)"
            )
        if config.communicator is not None:
            raise ValueError(
                f"--eplb-config: communicator {config.communicator!r} is not supported; Sonar moves expert weights "
                "with torch.distributed point-to-point over the tensor-parallel group (leave communicator unset)"
            )
        return config


def initial_placement(num_experts: int, num_slots: int, ranks: int, strategy: str) -> list[int]:
    """The placement before any load is known, after ``--expert-placement-strategy``: ``linear``,
    slot ``p`` holds expert ``p mod E`` (ranks take contiguous ranges, the redundant slots repeat
    the first experts); ``round_robin``, rank ``r``'s ``j``-th slot holds ``(r + j * ranks) mod E``.
    Without redundant slots these are the fixed placements of expert parallelism."""
    per_rank = num_slots // ranks
    if strategy == "round_robin":
        return [(r + j * ranks) % num_experts for r in range(ranks) for j in range(per_rank)]
    return [p % num_experts for p in range(num_slots)]


def replicate(load: Sequence[float], num_slots: int) -> list[int]:
    """Replicas per expert: one each, then each of the ``num_slots - E`` others to the expert of the
    highest load per replica (the lowest id on a tie)."""
    counts = [1] * len(load)
    hottest = [(-float(w), e) for e, w in enumerate(load)]  # a heap: the highest load per replica first
    heapq.heapify(hottest)
    for _ in range(num_slots - len(load)):
        _, e = heapq.heappop(hottest)
        counts[e] += 1
        heapq.heappush(hottest, (-load[e] / counts[e], e))
    return counts


def pack(weights: Sequence[float], num_packs: int) -> list[list[int]]:
    """The indices of `weights` in `num_packs` packs of ``len(weights) / num_packs`` each: heaviest
    first, each into the lightest pack with room (the lowest pack on a tie)."""
    per_pack = len(weights) // num_packs
    packs: list[list[int]] = [[] for _ in range(num_packs)]
    totals = [0.0] * num_packs
    for item in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        room = [k for k in range(num_packs) if len(packs[k]) < per_pack]
        k = min(room, key=lambda k: (totals[k], k))
        packs[k].append(item)
        totals[k] += weights[item]
    return packs


def rebalance(
    load: Sequence[float],
    num_slots: int,
    ranks: int,
    previous: Sequence[int] | None = None,
    num_groups: int = 1,
    num_nodes: int = 1,
) -> list[int]:
    """A layer's new placement (slot -> logical expert) for its experts' `load` (see the module
    docstring). `previous`, the placement it replaces, decides which rank and slot each expert
    takes, and is kept as it is unless the new placement lowers the busiest rank's load (the
    greedy packing is not optimal: a placement may already be better than the one it finds)."""
    num_experts = len(load)
    if num_slots % ranks or num_slots < num_experts:
        raise ValueError(f"{num_slots} expert slots over {ranks} ranks: not a multiple, or fewer than {num_experts}")
    if num_nodes < 1 or ranks % num_nodes or num_experts % num_groups or num_groups % num_nodes:
        num_groups, num_nodes = 1, 1  # the global policy: one node holds every group
    group_size = num_experts // num_groups
    group_load = [sum(load[g * group_size : (g + 1) * group_size]) for g in range(num_groups)]
    ranks_per_node, slots_per_node = ranks // num_nodes, num_slots // num_nodes
    rank_experts: list[list[int]] = []
    for groups in pack(group_load, num_nodes):
        experts = [g * group_size + i for g in sorted(groups) for i in range(group_size)]
        counts = replicate([load[e] for e in experts], slots_per_node)
        replicas = [(e, load[e] / c) for e, c in zip(experts, counts) for _ in range(c)]
        for items in pack([w for _, w in replicas], ranks_per_node):
            rank_experts.append(sorted(replicas[i][0] for i in items))
    if previous is None:
        return [e for experts in rank_experts for e in experts]
    placement = keep_slots(rank_experts, previous, ranks_per_node)
    if max(rank_loads(placement, load, ranks)) < max(rank_loads(previous, load, ranks)):
        return placement
    return list(previous)


def keep_slots(rank_experts: list[list[int]], previous: Sequence[int], ranks_per_node: int) -> list[int]:
    """`rank_experts` (each pack's experts) as a placement that moves little from `previous`: within
    each node, packs go to the ranks that hold most of their experts already (greedily), and on a
    rank an expert it already holds keeps its slot."""
    per_rank = len(rank_experts[0])
    old = [list(previous[r * per_rank : (r + 1) * per_rank]) for r in range(len(rank_experts))]
    held = [Counter(experts) for experts in old]
    wanted = [Counter(experts) for experts in rank_experts]
    placed: list[list[int] | None] = [None] * len(rank_experts)
    given: set[int] = set()
    for node in range(0, len(rank_experts), ranks_per_node):
        ranks = range(node, node + ranks_per_node)
        shared = {(k, r): sum((wanted[k] & held[r]).values()) for k in ranks for r in ranks}
        for k, r in sorted(shared, key=lambda kr: (-shared[kr], kr)):  # the largest overlaps first
            if placed[r] is None and k not in given:
                placed[r] = _lay_out(rank_experts[k], old[r])
                given.add(k)
    return [e for experts in placed if experts is not None for e in experts]


def _lay_out(new: list[int], old: list[int]) -> list[int]:
    """`new`'s experts in slots, each one `old` already has in a slot left where it is."""
    slots: list[int | None] = [None] * len(old)
    rest = list(new)
    for s, e in enumerate(old):
        if e in rest:
            slots[s] = e
            rest.remove(e)
    for s in range(len(slots)):
        if slots[s] is None:
            slots[s] = rest.pop(0)
    return [e for e in slots if e is not None]


def replica_counts(placement: Sequence[int], num_experts: int) -> list[int]:
    counts = [0] * num_experts
    for e in placement:
        counts[e] += 1
    return counts


def rank_loads(placement: Sequence[int], load: Sequence[float], ranks: int) -> list[float]:
    """Each rank's load under `placement`: every expert's load split evenly over its replicas (as
    tokens are dealt to them)."""
    counts = replica_counts(placement, len(load))
    per_rank = len(placement) // ranks
    return [sum(load[e] / counts[e] for e in placement[r * per_rank : (r + 1) * per_rank]) for r in range(ranks)]


def balancedness(placements: Sequence[Sequence[int]], loads: Sequence[Sequence[float]], ranks: int) -> float:
    """The layers' mean rank load over their largest, summed over the layers first (1.0: balanced,
    or no load at all)."""
    mean = peak = 0.0
    for placement, load in zip(placements, loads):
        per_rank = rank_loads(placement, load, ranks)
        mean += sum(per_rank) / ranks
        peak += max(per_rank)
    return mean / peak if peak else 1.0
