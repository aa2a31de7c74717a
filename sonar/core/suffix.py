"""Suffix decoding: draft tokens for speculative decoding from suffix indexes, with no model.

``SuffixProposer.propose`` matches the end of a request's tokens (prompt + output) against two
indexes and proposes the continuation that followed the match most often:

* the request's own index: every substring of its prompt and output so far;
* the global index: every substring of the outputs (not the prompts) of the last
  ``max_cached_requests`` finished requests (``finish`` adds one; the oldest is evicted first).

Both indexes are tries of all substrings of at most ``max_tree_depth`` tokens, each node
counting the occurrences of its substring. As in Arctic Inference (vLLM's ``method: "suffix"``),
the depth bounds the match length *plus* the draft length: a match of ``L`` tokens can propose
at most ``max_tree_depth - L`` tokens, so ``max_tree_depth=1`` never proposes anything.

A proposal, per call:

1. Candidates: for every match length ``L`` (``1 <= L < max_tree_depth``) for which the last
   ``L`` tokens occur earlier with a continuation, in either index.
2. Each candidate drafts at most ``min(max_tokens, ceil(max_spec_factor * L))`` tokens by
   following, from the matched node, the most frequent next token (ties: the smallest token id).
   The probability of a draft prefix is the *product* of the per-step frequencies
   ``count(next) / count(all continuations of this node)`` along the path: the chance, under the
   index's statistics, that the target model accepts every token so far. The draft stops before
   the first token whose cumulative probability falls below ``min_token_prob``.
3. The candidate with the highest score wins; the score is the sum of the cumulative
   probabilities of its tokens, the number of tokens the target is expected to accept. Ties go
   to the longer match, then to the request's own index over the global one. So a shorter match
   may win over a longer one when it is less ambiguous or has room for a longer draft, and the
   global index wins only when it promises more accepted tokens than the request's own.

Cost. The first call of a request indexes its prompt with numpy, ``O(len * depth)``. Each new
output token then touches at most ``max_tree_depth`` nodes (one per suffix still within the
depth): dict lookups, or binary searches for nodes of the prompt. Finding the longest matches is
``O(depth)``, the drafts ``O(depth * max_tokens)`` at worst and usually one or a few, as the
search over match lengths stops once no shorter match could score higher. Nothing scans the
whole context. A ``finish`` changes the global index, after which each running request matches
its last ``depth - 1`` tokens against it again on its next call (``O(match_len ** 2)``).
``finish`` itself is the heaviest call: ``O(len(output) * depth)`` to add the output, the same
again to evict the oldest.

Measured on the development machine (Python 3.11, one shared CPU core), for a 4,000-token
prompt: the first ``propose`` 25 ms (5 ms for a prompt of one 100-token block repeated), then
each of 200 calls with one more output token a median of 25 us (new text) to 75 us (output
copying the prompt, where every suffix matches), p99 under 0.2 ms. The index of that prompt
holds 95,000 nodes in about 13 MB. ``finish`` of a 1,000-token output: about 22 ms to add it,
35 ms more when it evicts one of the same size.

Memory is one node per distinct substring of at most ``max_tree_depth`` tokens: up to
``len * depth`` nodes per running request, and up to ``depth`` times the cached output tokens
for the global index (about 130 bytes a node: 10,000 cached outputs of 1,000 new tokens each
would take some 3 GB, so size ``max_cached_requests`` to the outputs).

Token ids must be non-negative and below ``2**32`` (they are packed into the edge keys).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["SuffixProposer"]

_ROOT = 0
# Edge keys pack (parent node, token) into one int: cheaper than tuples in a large dict.
_STRIDE = 1 << 32
# ceil(factor * length) of a product that should be an integer (0.1 * 30) must not round up.
_CEIL_SLACK = 1e-9


class _SuffixTrie:
    """Occurrence counts of every substring (of at most ``depth`` tokens) of indexed sequences.

    A node stands for one substring; ``_count[n]`` counts its occurrences, ``_cont[n]`` the
    occurrences followed by another token (the sum of its children's counts), and ``_best[n]``
    is its most frequent child (ties: the smallest token). An *active list* holds the nodes of
    the suffixes of a sequence being indexed or matched: ``active[d]`` is the node of its last
    ``d`` tokens, for ``d`` from 0 (the root) up to ``depth - 1``.

    Edges live in two places. The nodes made by ``build`` (a request's prompt) are found in
    ``_built``, the sorted list of their edge keys (node ``i + 1`` has key ``_built[i]``), by
    binary search: the list is made in a few milliseconds where a dict of the same edges takes
    tens. The nodes added later by ``extend`` are in the dict ``_child``. Only a built node (or
    the root) can have built children.

    A removable trie (the global index, never built) can forget a sequence it indexed. To find
    a new best child when the best one loses occurrences, it keeps the set of children of each
    node that has more than one (``_kids``; a node with a single child has it as its best).
    """

    __slots__ = ("depth", "_built", "_child", "_count", "_cont", "_best", "_token", "_kids", "_free")

    def __init__(self, depth: int, *, removable: bool = False) -> None:
        self.depth = depth
        self._built: list[int] = []
        self._child: dict[int, int] = {}
        self._count: list[int] = [0]
        self._cont: list[int] = [0]
        self._best: list[int] = [-1]
        self._token: list[int] = [-1]
        self._kids: dict[int, set[int]] | None = {} if removable else None
        self._free: list[int] = []

    @classmethod
    def build(cls, tokens: np.ndarray, depth: int) -> tuple[_SuffixTrie, list[int]]:
        """The trie of one sequence and its active list, as ``extend`` over every token would give.

        Vectorized, one level at a time: the substrings of length ``m`` are the pairs (node of
        the substring of length ``m - 1`` at the same start, next token). ``np.unique`` sorts
        and numbers them; as every parent of level ``m`` is numbered after those of level
        ``m - 1``, the keys of all levels end up sorted in node order.
        """
        trie = cls(depth)
        n = len(tokens)
        starts = np.zeros(n, dtype=np.int64)  # the node of the substring at each start position
        active = [_ROOT]
        keys, counts = [], []
        next_node = 1
        for m in range(1, min(n, depth) + 1):
            level = starts[: n - m + 1] * _STRIDE + tokens[m - 1 :]
            unique, inverse, count = np.unique(level, return_inverse=True, return_counts=True)
            starts = next_node + inverse.reshape(-1).astype(np.int64)
            next_node += len(unique)
            keys.append(unique)
            counts.append(count)
            if m < depth:
                active.append(int(starts[-1]))
        if next_node == 1:
            return trie, active
        key = np.concatenate(keys)
        count = np.concatenate(counts).astype(np.int64)
        parent, token = np.divmod(key, _STRIDE)
        cont = np.bincount(parent, weights=count, minlength=next_node).astype(np.int64)
        # The children of a parent are neighbours, by token: its best is the first at the maximum.
        group = np.flatnonzero(np.diff(parent, prepend=-1))
        top = np.repeat(np.maximum.reduceat(count, group), np.diff(group, append=len(parent)))
        at_top = np.flatnonzero(count == top)
        firsts = at_top[np.diff(parent[at_top], prepend=-1) != 0]
        best = np.full(next_node, -1, dtype=np.int64)
        best[parent[firsts]] = firsts + 1
        trie._built = key.tolist()
        trie._count = [0] + count.tolist()
        trie._cont = cont.tolist()
        trie._best = best.tolist()
        trie._token = [-1] + token.tolist()
        return trie, active

    @property
    def num_nodes(self) -> int:
        return len(self._count) - len(self._free)

    def child(self, node: int, token: int) -> int:
        key = node * _STRIDE + token
        built = self._built
        if node <= len(built):
            i = bisect_left(built, key)
            if i < len(built) and built[i] == key:
                return i + 1
        return self._child.get(key, -1)

    def _new_node(self, parent: int, token: int) -> int:
        if self._free:
            node = self._free.pop()
            self._count[node] = 0
            self._cont[node] = 0
            self._best[node] = -1
            self._token[node] = token
        else:
            node = len(self._count)
            self._count.append(0)
            self._cont.append(0)
            self._best.append(-1)
            self._token.append(token)
        sibling = self._best[parent]
        if self._kids is not None and sibling >= 0:
            kids = self._kids.get(parent)
            if kids is None:
                self._kids[parent] = {sibling, node}
            else:
                kids.add(node)
        self._child[parent * _STRIDE + token] = node
        return node

    def extend(self, active: list[int], token: int) -> list[int]:
        """Count one more token of the sequence whose suffixes are ``active``; return the new list."""
        child_of, count, cont, best, tok = self._child, self._count, self._cont, self._best, self._token
        built = self._built
        num_built = len(built)
        limit = self.depth - 1
        new = [_ROOT]
        for d, node in enumerate(active):
            key = node * _STRIDE + token
            c = -1
            if node <= num_built:
                i = bisect_left(built, key)
                if i < num_built and built[i] == key:
                    c = i + 1
            if c < 0:
                c = child_of.get(key, -1)
                if c < 0:
                    c = self._new_node(node, token)
            n = count[c] + 1
            count[c] = n
            cont[node] += 1
            b = best[node]
            if b < 0 or n > count[b] or (n == count[b] and token < tok[b]):
                best[node] = c
            if d < limit:
                new.append(c)
        return new

    def follow(self, active: list[int], token: int) -> list[int]:
        """Match one more token without counting it: the suffixes of the longer sequence that occur."""
        limit = self.depth - 1
        new = [_ROOT]
        for node in active[:limit]:
            c = self.child(node, token)
            if c < 0:
                break
            new.append(c)
        return new

    def match(self, tokens: Sequence[int]) -> list[int]:
        """The active list of ``tokens`` (only their last ``depth - 1`` matter), from scratch."""
        n = len(tokens)
        active = [_ROOT]
        for length in range(1, min(n, self.depth - 1) + 1):
            node = _ROOT
            for i in range(n - length, n):
                node = self.child(node, tokens[i])
                if node < 0:
                    return active
            active.append(node)
        return active

    def remove(self, tokens: Sequence[int]) -> None:
        """Forget one indexed sequence: undo what ``extend`` counted for each of its tokens."""
        child_of, count, cont, best, kids_of = self._child, self._count, self._cont, self._best, self._kids
        limit = self.depth - 1
        emptied: list[tuple[int, int]] = []
        stale: set[int] = set()  # nodes with several children whose best one lost occurrences
        active = [_ROOT]
        for token in tokens:
            new = [_ROOT]
            for d, node in enumerate(active):
                c = child_of[node * _STRIDE + token]
                n = count[c] - 1
                count[c] = n
                cont[node] -= 1
                if best[node] == c:
                    if node in kids_of:
                        stale.add(node)
                    elif n == 0:
                        best[node] = -1
                if n == 0:
                    emptied.append((node, c))
                if d < limit:
                    new.append(c)
            active = new
        # A node can empty before its children do (they count the same occurrences one token
        # later), so deletions wait until every count is settled.
        tok, free = self._token, self._free
        for parent, node in emptied:
            del child_of[parent * _STRIDE + tok[node]]
            free.append(node)
            stale.discard(node)
            if kids_of:
                kids_of.pop(node, None)
                # The parent may be gone already: its children empty with it, and go after it.
                kids = kids_of.get(parent)
                if kids is not None:
                    kids.discard(node)
                    if not kids:
                        del kids_of[parent]
        for node in stale:
            kids = kids_of.get(node)
            best[node] = min(kids, key=lambda c: (-count[c], tok[c])) if kids else -1

    def longest_continued(self, active: list[int]) -> int:
        """The longest suffix in ``active`` that occurs followed by a token (0: none).

        A longer suffix occurs only where a shorter one does, so the lengths with a
        continuation are ``1 .. longest``."""
        cont = self._cont
        length = len(active) - 1
        while length > 0 and cont[active[length]] == 0:
            length -= 1
        return length

    def draft(self, node: int, max_tokens: int, min_token_prob: float) -> tuple[list[int], float]:
        """Follow the most frequent children from ``node``; return the tokens and their score."""
        count, cont, best, tok = self._count, self._cont, self._best, self._token
        tokens: list[int] = []
        prob = 1.0
        score = 0.0
        while len(tokens) < max_tokens:
            total = cont[node]
            if total == 0:
                break
            node = best[node]
            prob *= count[node] / total
            if prob < min_token_prob:
                break
            tokens.append(tok[node])
            score += prob
        return tokens, score


@dataclass(slots=True)
class _RequestIndex:
    """What the proposer keeps of one running request."""

    prompt_len: int
    output: list[int]  # the output tokens indexed so far (the global index takes them at finish)
    trie: _SuffixTrie
    active: list[int]
    global_active: list[int]
    global_version: int  # of the global index when ``global_active`` was matched


class SuffixProposer:
    """Proposes draft tokens by suffix matching; see the module docstring for the rules."""

    def __init__(
        self,
        *,
        max_tree_depth: int = 24,
        max_cached_requests: int = 10000,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
    ) -> None:
        if isinstance(max_tree_depth, bool) or not isinstance(max_tree_depth, int) or max_tree_depth < 1:
            raise ValueError(f"max_tree_depth must be an integer >= 1, got {max_tree_depth!r}")
        if isinstance(max_cached_requests, bool) or not isinstance(max_cached_requests, int) or max_cached_requests < 0:
            raise ValueError(f"max_cached_requests must be an integer >= 0, got {max_cached_requests!r}")
        if not _is_number(max_spec_factor) or not max_spec_factor > 0 or math.isinf(max_spec_factor):
            raise ValueError(f"max_spec_factor must be a finite number > 0, got {max_spec_factor!r}")
        if not _is_number(min_token_prob) or not 0 <= min_token_prob <= 1:
            raise ValueError(f"min_token_prob must be a number in [0, 1], got {min_token_prob!r}")
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = float(max_spec_factor)
        self.min_token_prob = float(min_token_prob)
        self._requests: dict[str, _RequestIndex] = {}
        self._global = _SuffixTrie(max_tree_depth, removable=True)
        self._cached: deque[list[int]] = deque()
        # Bumped whenever the global index changes, which invalidates the requests' matches in it.
        self._global_version = 0
        self._limit_cache: dict[int, tuple[list[int], list[int]]] = {}

    @property
    def num_requests(self) -> int:
        """How many running requests the proposer keeps an index for."""
        return len(self._requests)

    @property
    def num_cached_requests(self) -> int:
        """How many finished requests' outputs the global index holds."""
        return len(self._cached)

    def propose(self, request_id: str, prompt: Sequence[int], output: Sequence[int], max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` draft tokens to follow ``prompt + output``; ``[]`` when nothing matches.

        Incremental: ``prompt`` must be the same on every call for a request and ``output`` only
        grow; only the new tail of ``output`` is indexed. An ``output`` shorter than what was
        indexed, or whose last indexed token changed, rebuilds the request's index.
        """
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens!r}")
        index = self._index(request_id, prompt, output)
        if max_tokens == 0:
            return []
        return self._best_draft(index, max_tokens)

    def finish(self, request_id: str) -> None:
        """Drop the request's index; add its output to the global index (evicting the oldest).

        The output is what the last ``propose`` saw: tokens sampled after it are indexed only by a
        ``propose(..., max_tokens=0)`` before ``finish``.
        """
        index = self._requests.pop(request_id, None)
        if index is None or self.max_cached_requests == 0 or not index.output:
            return
        active = [_ROOT]
        for token in index.output:
            active = self._global.extend(active, token)
        self._cached.append(index.output)
        while len(self._cached) > self.max_cached_requests:
            self._global.remove(self._cached.popleft())
        self._global_version += 1

    def _index(self, request_id: str, prompt: Sequence[int], output: Sequence[int]) -> _RequestIndex:
        index = self._requests.get(request_id)
        if index is not None:
            seen = len(index.output)
            if index.prompt_len != len(prompt) or len(output) < seen or (seen and output[seen - 1] != index.output[-1]):
                index = None
        if index is None:
            trie, active = _SuffixTrie.build(_token_array(prompt), self.max_tree_depth)
            index = _RequestIndex(len(prompt), [], trie, active, [_ROOT], -1)
            self._requests[request_id] = index
        seen = len(index.output)
        if len(output) > seen:
            tail = list(map(int, output[seen:]))
            if min(tail) < 0 or max(tail) >= _STRIDE:
                raise ValueError(f"token ids must be in [0, 2**32), got output {tail}")
            trie, active = index.trie, index.active
            for token in tail:
                active = trie.extend(active, token)
            index.active = active
            index.output.extend(tail)
            if index.global_version == self._global_version and self._cached:
                global_active = index.global_active
                for token in tail:
                    global_active = self._global.follow(global_active, token)
                index.global_active = global_active
        if index.global_version != self._global_version:
            index.global_active = self._global_suffix_nodes(prompt, output) if self._cached else [_ROOT]
            index.global_version = self._global_version
        return index

    def _global_suffix_nodes(self, prompt: Sequence[int], output: Sequence[int]) -> list[int]:
        want = self.max_tree_depth - 1
        if len(output) >= want:
            tail = list(map(int, output[len(output) - want :]))
        else:
            tail = list(map(int, prompt[max(0, len(prompt) - (want - len(output))) :])) + list(map(int, output))
        return self._global.match(tail)

    def _best_draft(self, index: _RequestIndex, max_tokens: int) -> list[int]:
        limit, bound = self._limits(max_tokens)
        sources = ((index.trie, index.active), (self._global, index.global_active))
        longest = [trie.longest_continued(active) for trie, active in sources]
        best: list[int] = []
        best_score = 0.0
        for length in range(max(longest), 0, -1):
            if best_score >= bound[length]:
                break
            for (trie, active), top in zip(sources, longest):
                if length <= top:
                    tokens, score = trie.draft(active[length], limit[length], self.min_token_prob)
                    if score > best_score:
                        best, best_score = tokens, score
        return best

    def _limits(self, max_tokens: int) -> tuple[list[int], list[int]]:
        """Per match length ``L``: the most tokens it may propose, and the best score any match of
        at most ``L`` tokens could reach (every token certain), which stops the search early."""
        max_tokens = min(max_tokens, self.max_tree_depth - 1)  # no match leaves room for more
        cached = self._limit_cache.get(max_tokens)
        if cached is None:
            depth = self.max_tree_depth
            limit = [0] * depth
            bound = [0] * depth
            for length in range(1, depth):
                spec = math.ceil(self.max_spec_factor * length - _CEIL_SLACK)
                limit[length] = min(max_tokens, spec, depth - length)
                bound[length] = max(bound[length - 1], limit[length])
            cached = self._limit_cache[max_tokens] = (limit, bound)
        return cached


def _token_array(tokens: Sequence[int]) -> np.ndarray:
    array = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if len(array) and (array.min() < 0 or array.max() >= _STRIDE):
        raise ValueError("token ids must be in [0, 2**32), got a prompt with one outside")
    return array


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
