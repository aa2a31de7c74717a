"""The placement decisions of expert load balancing (`sonar.core.eplb`): plain loads in,
placements out, and the invariants every placement keeps, beside hand-worked cases."""

from __future__ import annotations

import random

import pytest

from sonar.core import eplb
from sonar.core.eplb import EplbConfig


def check_invariants(placement: list[int], num_experts: int, num_slots: int, ranks: int) -> None:
    assert len(placement) == num_slots
    assert set(placement) == set(range(num_experts))  # every expert somewhere
    per_rank = num_slots // ranks
    assert len(placement) == per_rank * ranks


def test_the_initial_placements_are_expert_parallelism_s() -> None:
    assert eplb.initial_placement(4, 4, 2, "linear") == [0, 1, 2, 3]
    assert eplb.initial_placement(4, 4, 2, "round_robin") == [0, 2, 1, 3]
    assert eplb.initial_placement(4, 6, 2, "linear") == [0, 1, 2, 3, 0, 1]  # replicas of the first experts
    check_invariants(eplb.initial_placement(6, 8, 2, "round_robin"), 6, 8, 2)


def test_redundant_slots_go_to_the_highest_load_per_replica() -> None:
    assert eplb.replicate([10, 1, 1, 4], 6) == [3, 1, 1, 1]  # 10 -> 5 -> 3.3 against 4: then 4 gets none
    assert eplb.replicate([10, 1, 1, 8], 6) == [2, 1, 1, 2]
    assert eplb.replicate([1, 1], 2) == [1, 1]


def test_packing_fills_the_lightest_pack_with_room() -> None:
    packs = eplb.pack([9, 1, 8, 2], 2)
    assert packs == [[0, 1], [2, 3]]  # 9+1 and 8+2
    assert all(len(p) == 2 for p in packs)


def test_a_skewed_layer_is_rebalanced_and_improves() -> None:
    # linear placement over two ranks: experts 0 and 1 (the hot ones) on rank 0
    load = [100, 90, 5, 5]
    old = eplb.initial_placement(4, 4, 2, "linear")
    new = eplb.rebalance(load, 4, 2, previous=old)
    check_invariants(new, 4, 4, 2)
    assert sorted(new[:2]) != [0, 1]  # the hot experts no longer share a rank
    before = eplb.balancedness([old], [load], 2)
    after = eplb.balancedness([new], [load], 2)
    assert before == pytest.approx(100 / 190)
    assert after > 0.9 > before


def test_a_replica_splits_the_hottest_expert() -> None:
    load = [10, 10, 300, 10]
    old = eplb.initial_placement(4, 6, 2, "linear")  # [0, 1, 2, 3, 0, 1]: 310 against 20
    new = eplb.rebalance(load, 6, 2, previous=old)
    assert new.count(2) == 3  # both redundant slots: 300 / 3 = 100 per replica
    assert sorted(eplb.rank_loads(new, load, 2)) == [120, 210]  # 100 + 100 + 10 | 100 + 10 + 10
    assert eplb.balancedness([old], [load], 2) == pytest.approx(165 / 310)
    assert eplb.balancedness([new], [load], 2) == pytest.approx(165 / 210)


def test_a_placement_better_than_the_packing_s_is_kept() -> None:
    # greedy packing puts two of the hot expert's three replicas on one rank; the linear
    # placement's replicas already split it evenly
    load = [300, 10, 10, 10]
    old = eplb.initial_placement(4, 6, 2, "linear")
    assert eplb.balancedness([eplb.rebalance(load, 6, 2)], [load], 2) < 1.0
    assert eplb.rebalance(load, 6, 2, previous=old) == old


def test_experts_a_rank_keeps_stay_in_their_slots() -> None:
    old = [0, 1, 2, 3, 4, 5, 6, 7]
    load = [50, 1, 1, 1, 50, 1, 1, 1]  # one hot expert on each rank
    assert eplb.rebalance(load, 8, 2, previous=old) == old  # already balanced: nothing moves
    skewed = [50, 50, 1, 1, 1, 1, 1, 1]
    new = eplb.rebalance(skewed, 8, 2, previous=old)
    assert {new[:4].count(0), new[:4].count(1)} == {0, 1}  # the hot experts on different ranks
    for rank in (slice(0, 4), slice(4, 8)):  # what a rank keeps stays in its slot
        for e in set(old[rank]) & set(new[rank]):
            assert old.index(e) == new.index(e)
    assert sum(a == b for a, b in zip(old, new)) == 4  # packing deals the cold experts in turn


def test_hierarchical_packing_keeps_groups_on_their_node() -> None:
    # 8 experts in 4 groups of 2, 2 nodes of 2 ranks each: a node holds whole groups
    load = [40, 30, 1, 1, 20, 20, 2, 2]
    new = eplb.rebalance(load, 8, 4, num_groups=4, num_nodes=2)
    check_invariants(new, 8, 8, 4)
    for node in (new[:4], new[4:]):
        groups = {e // 2 for e in node}
        assert len(groups) == 2 and all(sum(e // 2 == g for e in node) == 2 for g in groups)
    # groups by load 0 (70), 2 (40), 3 (4), 1 (2): 70 | 40, then 4 to the lighter node, 2 to the other
    assert ({e // 2 for e in new[:4]}, {e // 2 for e in new[4:]}) == ({0, 1}, {2, 3})


def test_random_loads_keep_the_invariants_and_never_worsen_balance() -> None:
    rng = random.Random(0)
    for _ in range(200):
        ranks = rng.choice([2, 4])
        experts = ranks * rng.randint(1, 4)
        slots = experts + ranks * rng.randint(0, 2)
        load = [rng.expovariate(1.0) * rng.choice([1, 1, 20]) for _ in range(experts)]
        old = eplb.initial_placement(experts, slots, ranks, rng.choice(["linear", "round_robin"]))
        new = eplb.rebalance(load, slots, ranks, previous=old)
        fresh = eplb.rebalance(load, slots, ranks)
        for placement in (new, fresh):
            check_invariants(placement, experts, slots, ranks)
        if new != old:  # the packing's experts, laid out near the old slots, and better
            assert sorted(new) == sorted(fresh)
            assert max(eplb.rank_loads(new, load, ranks)) == pytest.approx(max(eplb.rank_loads(fresh, load, ranks)))
            assert eplb.balancedness([new], [load], ranks) > eplb.balancedness([old], [load], ranks)
        # greedy packing's bound: no rank above the mean by more than the heaviest replica
        counts = eplb.replica_counts(fresh, experts)
        heaviest = max(load[e] / counts[e] for e in range(experts))
        assert max(eplb.rank_loads(fresh, load, ranks)) <= sum(load) / ranks + heaviest + 1e-9


def test_no_load_is_balanced() -> None:
    assert eplb.balancedness([[0, 1]], [[0, 0]], 2) == 1.0


def test_the_config_takes_the_reference_fields_and_refuses_what_sonar_does_not_do() -> None:
    config = EplbConfig.parse({"window_size": 10, "step_interval": 5, "num_redundant_experts": 2})
    assert (config.window_size, config.step_interval, config.num_redundant_experts) == (10, 5, 2)
    assert EplbConfig.parse({}) == EplbConfig()
    refusals = {
        "use_async": ({"use_async": True}, "use_async true is not supported"),
        "policy": ({"policy": "flashlb"}, "policy 'flashlb' is not supported"),
        "communicator": ({"communicator": "pynccl"}, "communicator 'pynccl' is not supported"),
        "window": ({"window_size": 0}, "window_size must be at least 1"),
        "redundant": ({"num_redundant_experts": -1}, "num_redundant_experts must be 0 or more"),
        "unknown": ({"windows": 3}, "unknown field `windows`"),
    }
    for raw, message in refusals.values():
        with pytest.raises(ValueError, match=message):
            EplbConfig.parse(raw)
