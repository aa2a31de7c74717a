"""The data-parallel router's core: which engine replica serves a request.

Each replica is a whole engine with its own prefix cache, so a prompt is cheapest on the replica
that already holds its longest prefix. The router cannot see those caches; it keeps its own
approximate view of them instead: per replica, the prefix-cache block hashes of the prompts it
sent there (the same hash chain the scheduler keys its cache by, `sonar.core.prefix`, cache salt
included), least recently used first, at most `capacity` per replica (a replica cannot cache more
blocks than its KV cache has). Blocks a replica evicted under pressure, or lost in a restart, are
still in the view until the router ages them out or is told (`forget`): a stale entry costs one
request a cache miss, never a wrong answer.

`route(block_hashes)` decides in this order:

1. only replicas that take requests (`set_available`) count; with none, the answer is None; of
   those, a replica whose worker is restarting (`set_restarting`: a crash, a lost node) counts only
   when every one is (its requests wait there until the worker is back); requests moved off a
   lost replica (`avoid`) go only to one that serves now;
2. the baseline is the least loaded replica: fewest requests in flight (sent by this router and
   not yet `finished`), then the lowest KV usage (`set_kv_usage`, from the replicas' stats), then
   the one chosen least recently (so one-at-a-time requests alternate);
3. with `prefix_affinity`, the replica whose view holds the longest run of the prompt's leading
   blocks (ties by the same load order) wins over the baseline, unless it has more than
   `balance_slack` requests in flight beyond the baseline's: a cache hit is worth a wait, not an
   unbounded queue behind one popular prefix;
4. the chosen replica's view takes every full block of the prompt (it will compute and cache
   them), its leaves first so that eviction, like the scheduler's, drops a chain from its tail.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from sonar.core.prefix import BlockHash

__all__ = ["Router", "RouterStats"]


@dataclass
class RouterStats:
    """What the router decided since it started (cumulative)."""

    routed: list[int]
    """Requests sent to each replica."""
    affine: int = 0
    """Requests sent where the router's view held part of their prompt."""
    matched_blocks: int = 0
    """Prompt blocks the chosen replicas' views held, over all requests."""


class Router:
    """Chooses a replica per request (see the module docstring); plain values in and out."""

    def __init__(
        self, num_replicas: int, capacity: int, *, prefix_affinity: bool = True, balance_slack: int = 16
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
        if capacity < 0:
            raise ValueError(f"capacity must not be negative, got {capacity}")
        if balance_slack < 0:
            raise ValueError(f"balance_slack must not be negative, got {balance_slack}")
        self.capacity = capacity
        self.prefix_affinity = prefix_affinity
        self.balance_slack = balance_slack
        self.views: list[OrderedDict[BlockHash, None]] = [OrderedDict() for _ in range(num_replicas)]
        self.in_flight = [0] * num_replicas
        self.kv_usage = [0.0] * num_replicas
        self.available = [True] * num_replicas
        self.restarting = [False] * num_replicas
        self.stats = RouterStats(routed=[0] * num_replicas)
        self._last_chosen = [0] * num_replicas
        self._decisions = 0

    @property
    def num_replicas(self) -> int:
        return len(self.views)

    def matched(self, replica: int, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of a prompt `replica`'s view holds."""
        view = self.views[replica]
        count = 0
        for h in block_hashes:
            if h not in view:
                break
            count += 1
        return count

    def route(self, block_hashes: Sequence[BlockHash], requests: int = 1, avoid: int | None = None) -> int | None:
        """The replica for a prompt with these block hashes (`requests` engine requests: its ``n``
        completions), or None when no replica is available. Counts them in flight there until
        `finished`. `avoid`: requests moved off that lost replica go to another that serves now
        (available and not restarting), else nowhere (None)."""
        candidates = [i for i in range(self.num_replicas) if self.available[i] and i != avoid]
        serving = [i for i in candidates if not self.restarting[i]]
        candidates = serving if avoid is not None else serving or candidates
        if not candidates:
            return None
        chosen = min(candidates, key=self._load)
        matched = 0
        if self.prefix_affinity and block_hashes:
            best = max(candidates, key=lambda i: (self.matched(i, block_hashes), [-x for x in self._load(i)]))
            best_matched = self.matched(best, block_hashes)
            if best_matched and self.in_flight[best] - self.in_flight[chosen] <= self.balance_slack:
                chosen = best
            matched = self.matched(chosen, block_hashes)
        elif block_hashes:
            matched = self.matched(chosen, block_hashes)
        self._remember(chosen, block_hashes)
        self.in_flight[chosen] += requests
        self._decisions += 1
        self._last_chosen[chosen] = self._decisions
        self.stats.routed[chosen] += requests
        if matched:
            self.stats.affine += requests
            self.stats.matched_blocks += matched
        return chosen

    def finished(self, replica: int, requests: int = 1) -> None:
        """`requests` routed to `replica` ended (finished, failed or aborted)."""
        self.in_flight[replica] = max(0, self.in_flight[replica] - requests)

    def set_kv_usage(self, replica: int, usage: float) -> None:
        self.kv_usage[replica] = usage

    def set_available(self, replica: int, available: bool) -> None:
        """Take `replica` out of (or back into) routing; taken out, its view is forgotten (a
        replica that comes back after a crash starts with an empty cache)."""
        self.available[replica] = available
        if not available:
            self.forget(replica)

    def set_restarting(self, replica: int, restarting: bool) -> None:
        """Mark `replica`'s worker as restarting (its view is forgotten: the restarted worker's
        cache starts empty), or back."""
        self.restarting[replica] = restarting
        if restarting:
            self.forget(replica)

    def forget(self, replica: int) -> None:
        """Drop `replica`'s view (its cache was lost: a restarted worker)."""
        self.views[replica].clear()

    def _load(self, replica: int) -> tuple[int, float, int]:
        return self.in_flight[replica], self.kv_usage[replica], self._last_chosen[replica]

    def _remember(self, replica: int, block_hashes: Sequence[BlockHash]) -> None:
        if not self.capacity:
            return
        view = self.views[replica]
        for h in reversed(block_hashes[: self.capacity]):
            if h in view:
                view.move_to_end(h)
            else:
                view[h] = None
        while len(view) > self.capacity:
            view.popitem(last=False)
