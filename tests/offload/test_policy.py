"""Eviction orders: LRU, and ARC's scan resistance."""

import pytest

from sonar.offload.policy import ARCPolicy, LRUPolicy, make_policy


def k(i: int) -> bytes:
    return i.to_bytes(4, "big")


def test_lru_order_follows_use():
    p = LRUPolicy()
    for i in range(4):
        p.insert(k(i))
    p.touch(k(0))
    p.remove(k(2))
    assert [p.pop_victim() for _ in range(3)] == [k(1), k(3), k(0)]
    with pytest.raises(IndexError):
        p.pop_victim()


def simulate(policy, capacity, accesses):
    """Hits of a cache of ``capacity`` keys under ``policy`` over ``accesses``."""
    resident, hits = set(), 0
    for key in accesses:
        if key in resident:
            hits += 1
            policy.touch(key)
            continue
        if len(resident) >= capacity:
            resident.discard(policy.pop_victim())
        resident.add(key)
        policy.insert(key)
        assert len(policy) == len(resident)
    return hits


def test_arc_keeps_a_hot_set_through_a_scan():
    """A hot set used twice, then a long one-off scan, then the hot set again: LRU loses the hot
    set to the scan, ARC keeps it (it was promoted to the frequency list)."""
    hot = [k(i) for i in range(4)]
    scan = [k(100 + i) for i in range(40)]
    accesses = hot + hot + scan + hot
    assert simulate(ARCPolicy(6), 6, accesses) > simulate(LRUPolicy(), 6, accesses)


def test_arc_ghost_hit_adapts_the_target():
    p = ARCPolicy(2)
    p.insert(k(1))
    p.insert(k(2))
    assert p.pop_victim() == k(1)  # to ghost list B1
    p.insert(k(1))  # a B1 ghost hit: recency deserves more room
    assert p.p > 0 and k(1) in p.t2


def test_make_policy():
    assert isinstance(make_policy("lru", 3), LRUPolicy)
    assert isinstance(make_policy("arc", 3), ARCPolicy)
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("mru", 3)
