"""The data-parallel router's core with plain values: prefix affinity, load balancing, the bound on
its view, availability; and a randomized run against a model of what the replicas cache."""

from __future__ import annotations

import random

import pytest

from sonar.core.prefix import PrefixHasher
from sonar.core.routing import Router

HASHER = PrefixHasher(4)


def chain(tokens: list[int], salt: str | None = None) -> list[bytes]:
    return HASHER.chain(tokens, salt)


def test_distinct_prompts_alternate_between_idle_replicas() -> None:
    router = Router(2, capacity=100)
    picks = []
    for i in range(6):
        picks.append(router.route(chain([i] * 8)))
        router.finished(picks[-1])
    assert picks == [0, 1, 0, 1, 0, 1]
    assert router.stats.routed == [3, 3] and router.stats.affine == 0


def test_requests_in_flight_go_to_the_least_loaded_replica() -> None:
    router = Router(3, capacity=100)
    assert [router.route(chain([i] * 8)) for i in range(3)] == [0, 1, 2]
    router.finished(1)
    assert router.route(chain([9] * 8)) == 1
    assert router.in_flight == [1, 1, 1]
    router.set_kv_usage(0, 0.9)
    router.set_kv_usage(1, 0.5)
    router.set_kv_usage(2, 0.7)
    assert router.route(chain([10] * 8)) == 1  # equal counts: the lower KV usage


def test_a_shared_prefix_follows_the_replica_that_computed_it() -> None:
    router = Router(2, capacity=100)
    system = list(range(100, 132))  # 8 blocks
    first = router.route(chain(system + [1, 2, 3, 4]))
    other = router.route(chain([7] * 16))  # something unrelated lands on the other replica
    assert {first, other} == {0, 1}
    for i in range(5):
        assert router.route(chain(system + [i] * 4)) == first
    assert router.stats.affine == 5 and router.stats.matched_blocks == 5 * 8


def test_the_longest_match_wins() -> None:
    router = Router(2, capacity=100)
    a = list(range(16))
    assert router.route(chain(a[:8])) == 0  # replica 0 holds 2 blocks of `a`
    assert router.route(chain(a)) == 0  # ...now all 4
    router.views[1].clear()
    router._remember(1, chain(a[:4]))  # replica 1 holds 1 block
    router.finished(0, 2)
    assert router.matched(0, chain(a)) == 4 and router.matched(1, chain(a)) == 1
    assert router.route(chain(a + [5] * 4)) == 0


def test_a_salt_keeps_prefixes_apart() -> None:
    router = Router(2, capacity=100)
    tokens = list(range(32))
    assert router.route(chain(tokens, "tenant-a")) == 0
    assert router.route(chain(tokens, "tenant-b")) == 1  # no hit for another salt: by load
    assert router.route(chain(tokens, "tenant-a")) == 0


def test_affinity_yields_to_load_past_the_slack() -> None:
    router = Router(2, capacity=100, balance_slack=2)
    prefix = list(range(40))
    picks = [router.route(chain(prefix + [i] * 4)) for i in range(6)]
    # 0 takes the prefix and keeps it while at most 2 more are in flight there than on 1; then 1
    # computes it too, and with both holding it the load decides
    assert picks == [0, 0, 0, 1, 1, 1]
    assert router.in_flight == [3, 3]


def test_without_affinity_only_load_counts() -> None:
    router = Router(2, capacity=100, prefix_affinity=False)
    prefix = list(range(40))
    picks = []
    for i in range(4):
        picks.append(router.route(chain(prefix + [i] * 4)))
        router.finished(picks[-1])
    assert picks == [0, 1, 0, 1]
    assert router.stats.affine == 2  # the view still says where the prefix was cached


def test_short_prompts_without_a_full_block_route_by_load() -> None:
    router = Router(2, capacity=100)
    assert [router.route([]) for _ in range(3)] == [0, 1, 0]


def test_the_view_is_bounded_and_evicts_chains_from_their_tail() -> None:
    router = Router(1, capacity=6)
    a, b = chain(list(range(16))), chain(list(range(50, 66)))  # 4 blocks each
    router.route(a)
    router.route(b)
    view = router.views[0]
    assert len(view) == 6
    assert router.matched(0, b) == 4
    assert router.matched(0, a) == 2  # a's last two blocks went first; its head survives
    router.route(chain(list(range(200, 240))))  # 10 blocks: more than the capacity
    assert len(view) == 6 and router.matched(0, a) == 0


def test_an_unavailable_replica_is_skipped_and_forgotten() -> None:
    router = Router(2, capacity=100)
    prefix = chain(list(range(32)))
    assert router.route(prefix) == 0
    router.set_available(0, False)
    assert router.route(prefix) == 1
    router.set_available(1, False)
    assert router.route(prefix) is None
    router.set_available(0, True)
    assert router.matched(0, prefix) == 0 and router.route(prefix) == 0


def test_a_replica_whose_worker_restarts_takes_requests_only_when_all_do() -> None:
    router = Router(2, capacity=100)
    prefix = chain(list(range(32)))
    assert router.route(prefix) == 0
    router.set_restarting(0, True)
    assert router.route(prefix) == 1 and router.route(prefix) == 1  # the cache hit is lost with the worker
    router.set_restarting(1, True)
    assert router.route(chain(list(range(100, 132)))) == 0  # queued there until a worker is back
    router.set_restarting(0, False)
    router.set_restarting(1, False)
    assert router.matched(0, prefix) == 0 and router.matched(1, prefix) == 0


def test_requests_moved_off_a_lost_replica_go_only_to_one_that_serves() -> None:
    router = Router(3, capacity=100)
    prefix = chain(list(range(32)))
    assert router.route(prefix) == 0
    router.set_restarting(0, True)
    router.set_restarting(1, True)
    assert router.route(prefix, avoid=0) == 2
    router.set_available(2, False)
    assert router.route(prefix, avoid=0) is None  # replica 1 restarts too: nowhere to move to
    assert router.route(prefix) in (0, 1)  # a new request still waits for a worker


def test_bad_arguments_are_refused() -> None:
    for kwargs in ({"num_replicas": 0, "capacity": 1}, {"num_replicas": 1, "capacity": -1}):
        with pytest.raises(ValueError):
            Router(**kwargs)
    with pytest.raises(ValueError, match="balance_slack"):
        Router(2, 10, balance_slack=-1)


def test_randomized_affinity_beats_load_only_and_stays_balanced() -> None:
    """Groups of prompts share long prefixes; each replica caches what it computed (an LRU as big as
    the router's view). Affinity must hit more often than load alone and keep the load within
    the slack."""
    rng = random.Random(7)
    prefixes = [[rng.randrange(1000) for _ in range(64)] for _ in range(6)]
    prompts = [prefixes[rng.randrange(6)] + [rng.randrange(1000) for _ in range(8)] for _ in range(300)]

    def run(affinity: bool) -> float:
        router = Router(2, capacity=64, prefix_affinity=affinity, balance_slack=4)
        caches: list[dict[bytes, None]] = [{}, {}]
        hits = total = 0
        window: list[int] = []
        for tokens in prompts:
            hashes = chain(tokens)
            replica = router.route(hashes)
            assert replica is not None
            assert abs(router.in_flight[0] - router.in_flight[1]) <= 4 + 1
            cache = caches[replica]
            for h in hashes:
                if h not in cache:
                    break
                hits += 1
            total += len(hashes)
            for h in hashes:
                cache.pop(h, None)
                cache[h] = None
            while len(cache) > 64:
                del cache[next(iter(cache))]
            window.append(replica)
            if len(window) > 4:  # four requests in flight at a time
                router.finished(window.pop(0))
        assert min(router.stats.routed) > 0
        return hits / total

    assert run(True) > run(False) + 0.1
