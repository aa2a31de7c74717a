"""Suffix decoding proposer: hand-written cases, then seeded random runs against a brute force."""

from __future__ import annotations

import math
import random
from collections import Counter

import numpy as np
import pytest

from sonar.core.suffix import SuffixProposer


def reference_propose(
    tokens: list[int],
    cached_outputs: list[list[int]],
    *,
    max_tree_depth: int,
    max_tokens: int,
    max_spec_factor: float,
    min_token_prob: float,
) -> list[int]:
    """The rules of the module docstring, by scanning every sequence for every candidate."""
    n = len(tokens)
    best: list[int] = []
    best_score = 0.0
    for length in range(min(n, max_tree_depth - 1), 0, -1):
        limit = min(max_tokens, math.ceil(max_spec_factor * length - 1e-9), max_tree_depth - length)
        for corpus in ([tokens], cached_outputs):
            draft, score = reference_draft(tokens[n - length :], corpus, limit, min_token_prob)
            if score > best_score:
                best, best_score = draft, score
    return best


def reference_draft(pattern: list[int], corpus: list[list[int]], limit: int, min_token_prob: float):
    path = list(pattern)
    draft: list[int] = []
    prob = 1.0
    score = 0.0
    while len(draft) < limit:
        m = len(path)
        follows = Counter(seq[i + m] for seq in corpus for i in range(len(seq) - m) if seq[i : i + m] == path)
        if not follows:
            break
        token = min(follows, key=lambda t: (-follows[t], t))
        prob *= follows[token] / sum(follows.values())
        if prob < min_token_prob:
            break
        draft.append(token)
        path.append(token)
        score += prob
    return draft, score


def test_repeated_prompt_text_is_proposed() -> None:
    proposer = SuffixProposer()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 20, 21]
    # A match of three tokens proposes at most three (max_spec_factor 1).
    assert proposer.propose("r", prompt, [1, 2, 3], max_tokens=10) == [4, 5, 6]
    assert proposer.propose("r", prompt, [1, 2, 3, 4], max_tokens=10) == [5, 6, 7, 8]
    # A token never seen before ends every match.
    assert proposer.propose("r", prompt, [1, 2, 3, 4, 99], max_tokens=10) == []


def test_max_tokens_caps_the_draft() -> None:
    proposer = SuffixProposer()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert proposer.propose("r", prompt, [1, 2, 3], max_tokens=2) == [4, 5]
    assert proposer.propose("r", prompt, [1, 2, 3], max_tokens=0) == []


def test_max_spec_factor_scales_with_the_match_length() -> None:
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    half = SuffixProposer(max_spec_factor=0.5)
    assert half.propose("r", prompt, [1, 2, 3], max_tokens=10) == [4, 5]  # ceil(0.5 * 3)
    double = SuffixProposer(max_spec_factor=2.0)
    assert double.propose("r", prompt, [1, 2, 3], max_tokens=10) == [4, 5, 6, 7, 8, 9]
    assert double.propose("r", prompt, [1, 2, 3], max_tokens=4) == [4, 5, 6, 7]


def test_max_tree_depth_bounds_match_plus_draft() -> None:
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    # Depth 5: the three-token match leaves room for two tokens; a one-token match for four, but
    # it may propose only one (max_spec_factor 1); two tokens certain beat one.
    assert SuffixProposer(max_tree_depth=5).propose("r", prompt, [1, 2, 3], max_tokens=10) == [4, 5]
    assert SuffixProposer(max_tree_depth=5, max_spec_factor=4).propose("r", prompt, [3], 10) == [4, 5, 6, 7]
    assert SuffixProposer(max_tree_depth=1).propose("r", prompt, [1, 2, 3], max_tokens=10) == []


def test_min_token_prob_cuts_an_ambiguous_continuation() -> None:
    # "1 2" went on with 3 twice and with 4 once; "1 2 3" then with 5 once and 6 once.
    prompt = [1, 2, 3, 5, 10, 1, 2, 3, 6, 11, 1, 2, 4, 7, 12]
    output = [1, 2]

    def propose(min_token_prob: float) -> list[int]:
        return SuffixProposer(min_token_prob=min_token_prob).propose("r", prompt, output, max_tokens=2)

    assert propose(0.1) == [3, 5]  # 2/3, then 2/3 * 1/2 = 1/3; ties go to the smaller token
    # The product, not the step: 1/2 passes 0.4 on its own, 1/3 does not.
    assert propose(0.4) == [3]
    assert propose(0.7) == []
    assert propose(0.0) == [3, 5]


def test_a_certain_shorter_match_beats_an_ambiguous_longer_one() -> None:
    # "8 1" went on with 2 once and 3 once; "1" went on with 2 five times out of six overall.
    prompt = [8, 1, 2, 8, 1, 3, 1, 2, 1, 2, 1, 2, 1, 2, 0, 8]
    proposer = SuffixProposer(min_token_prob=0.0)
    assert proposer.propose("r", prompt, [1], max_tokens=1) == [2]


def test_global_index_proposes_from_finished_outputs() -> None:
    proposer = SuffixProposer()
    assert proposer.propose("a", [100, 101, 102], [1, 2, 3, 4, 5, 6], max_tokens=5) == []
    # A running request's output is not shared yet.
    assert proposer.propose("b", [7, 8, 1, 2, 3], [], max_tokens=5) == []
    proposer.finish("a")
    assert proposer.num_cached_requests == 1
    # "b" has no match of its own: its suffix "1 2 3" continues as in "a"'s output.
    assert proposer.propose("b", [7, 8, 1, 2, 3], [], max_tokens=5) == [4, 5, 6]
    assert proposer.propose("b", [7, 8, 1, 2, 3], [4], max_tokens=5) == [5, 6]
    # Prompts are not indexed globally.
    assert proposer.propose("c", [9, 100, 101], [], max_tokens=5) == []


def test_the_request_wins_ties_and_the_more_probable_source_wins() -> None:
    proposer = SuffixProposer(min_token_prob=0.0)
    proposer.propose("done", [], [1, 2, 3, 50, 51], max_tokens=1)
    proposer.finish("done")
    # Same match, both certain: the request's own continuation.
    assert proposer.propose("tie", [1, 2, 3, 40, 41, 1, 2, 3], [], max_tokens=2) == [40, 41]
    # The request's own continuation is a coin toss; the global one is certain.
    assert proposer.propose("coin", [1, 2, 3, 40, 8, 1, 2, 3, 41, 9, 1, 2, 3], [], max_tokens=2) == [50, 51]


def test_eviction_keeps_the_newest_outputs() -> None:
    proposer = SuffixProposer(max_cached_requests=2)
    for i, output in enumerate(([1, 2, 3, 4], [11, 12, 13, 14], [21, 22, 23, 24])):
        proposer.propose(f"r{i}", [0], output, max_tokens=1)
        proposer.finish(f"r{i}")
    assert proposer.num_cached_requests == 2
    assert proposer.propose("new", [5, 1, 2], [], max_tokens=3) == []
    assert proposer.propose("new2", [5, 11, 12], [], max_tokens=3) == [13, 14]
    assert proposer.propose("new3", [5, 21, 22], [], max_tokens=3) == [23, 24]


def test_max_cached_requests_zero_disables_the_global_index() -> None:
    proposer = SuffixProposer(max_cached_requests=0)
    proposer.propose("a", [0], [1, 2, 3, 4], max_tokens=1)
    proposer.finish("a")
    assert proposer.num_cached_requests == 0
    assert proposer.propose("b", [5, 1, 2], [], max_tokens=3) == []


def test_finish_drops_the_request() -> None:
    proposer = SuffixProposer()
    proposer.propose("a", [1, 2, 3, 1, 2], [3], max_tokens=2)
    proposer.propose("b", [4, 5], [], max_tokens=2)
    assert proposer.num_requests == 2
    proposer.finish("a")
    proposer.finish("a")  # twice, or for a request never seen: nothing to do
    proposer.finish("never")
    assert proposer.num_requests == 1
    assert proposer.num_cached_requests == 1
    # The id comes back with another prompt of the same length and the same output: a kept
    # index would propose [1, 2] from the old "1 2 3 1 2 3"; a new one finds nothing.
    assert proposer.propose("a", [7, 8, 9, 7, 8], [3], max_tokens=2) == []


def test_a_shorter_or_rewritten_output_rebuilds_the_index() -> None:
    prompt = [1, 2, 3, 4, 5, 6]
    proposer = SuffixProposer()
    assert proposer.propose("r", prompt, [1, 2, 3, 4], max_tokens=3) == [5, 6, 1]
    assert proposer.propose("r", prompt, [1, 2], max_tokens=3) == [3, 4]
    assert proposer.propose("r", prompt, [1, 7], max_tokens=3) == []
    # "1 7 1" matches the output itself; its continuation ends where the output does.
    assert proposer.propose("r", prompt, [1, 7, 1, 7, 1], max_tokens=3) == [7, 1]


def test_numpy_token_arrays_are_accepted() -> None:
    proposer = SuffixProposer()
    prompt = np.array([1, 2, 3, 4, 5, 6], dtype=np.int32)
    assert proposer.propose("r", prompt, np.array([1, 2, 3], dtype=np.int64), max_tokens=3) == [4, 5, 6]
    assert all(type(t) is int for t in proposer.propose("r", prompt, [1, 2, 3], max_tokens=3))


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"max_tree_depth": 0}, "max_tree_depth"),
        ({"max_tree_depth": 2.5}, "max_tree_depth"),
        ({"max_cached_requests": -1}, "max_cached_requests"),
        ({"max_spec_factor": 0}, "max_spec_factor"),
        ({"max_spec_factor": -1.0}, "max_spec_factor"),
        ({"max_spec_factor": float("nan")}, "max_spec_factor"),
        ({"min_token_prob": -0.1}, "min_token_prob"),
        ({"min_token_prob": 1.5}, "min_token_prob"),
        ({"min_token_prob": float("nan")}, "min_token_prob"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        SuffixProposer(**kwargs)


def test_negative_max_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        SuffixProposer().propose("r", [1], [], max_tokens=-1)


@pytest.mark.parametrize(("prompt", "output"), [([1, -1], []), ([1, 2**32], []), ([1, 2], [3, -5])])
def test_token_ids_outside_the_key_range_are_refused(prompt: list[int], output: list[int]) -> None:
    proposer = SuffixProposer()
    with pytest.raises(ValueError, match="token ids"):
        proposer.propose("r", prompt, output, max_tokens=2)
    # Nothing half-indexed is left behind: a good call afterwards proposes as usual.
    assert proposer.propose("r", [1, 2, 3, 1, 2], [], max_tokens=2) == [3, 1]


def test_long_requests_at_the_default_depth_match_a_fresh_index() -> None:
    rng = random.Random(7)
    proposer = SuffixProposer()
    prompt = [rng.randrange(8) for _ in range(2000)]
    output: list[int] = []
    proposed = 0
    for step in range(300):
        output += [rng.randrange(8) for _ in range(rng.randint(1, 3))]
        got = proposer.propose("r", prompt, output, max_tokens=5)
        proposed += bool(got)
        if step % 25 == 0:
            assert got == proposer.propose(f"fresh{step}", prompt + output, [], max_tokens=5)
            proposer.finish(f"fresh{step}")
    assert proposed > 100  # eight tokens repeat a lot: most calls have something to propose


def distinct_substrings(outputs: list[list[int]], depth: int) -> int:
    return len({tuple(seq[i : i + m]) for seq in outputs for m in range(1, depth + 1) for i in range(len(seq) - m + 1)})


@pytest.mark.parametrize("seed", range(40))
def test_incremental_proposals_match_the_brute_force(seed: int) -> None:
    """Requests grow in random chunks and finish; every proposal equals the brute force's and a
    fresh request's fed the whole sequence at once, and the global index holds exactly the
    substrings of the outputs it keeps (evicted ones leave nothing behind)."""
    rng = random.Random(seed)
    params = {
        "max_tree_depth": rng.choice([1, 2, 3, 5, 8, 24]),
        "max_cached_requests": rng.choice([0, 1, 2, 3]),
        "max_spec_factor": rng.choice([0.5, 1.0, 1.5, 3.0]),
        "min_token_prob": rng.choice([0.0, 0.1, 0.3, 0.6, 1.0]),
    }
    proposer = SuffixProposer(**params)
    # A small vocabulary repeats often; the extreme ids check how edges are keyed.
    vocab = rng.sample([0, 1, 7, 2**31, 2**32 - 1], rng.randint(2, 4))
    cached: list[list[int]] = []
    checks = 0
    for r in range(rng.randint(2, 5)):
        rid = f"r{r}"
        prompt = [rng.choice(vocab) for _ in range(rng.randint(0, 30))]
        output: list[int] = []
        for _ in range(rng.randint(1, 12)):
            output += [rng.choice(vocab) for _ in range(rng.randint(0, 3))]
            max_tokens = rng.randint(0, 6)
            got = proposer.propose(rid, prompt, output, max_tokens)
            fresh = proposer.propose(f"{rid}-fresh-{checks}", prompt + output, [], max_tokens)
            proposer.finish(f"{rid}-fresh-{checks}")  # an empty output adds nothing
            want = reference_propose(
                prompt + output,
                cached,
                max_tree_depth=params["max_tree_depth"],
                max_tokens=max_tokens,
                max_spec_factor=params["max_spec_factor"],
                min_token_prob=params["min_token_prob"],
            )
            assert got == fresh == want, (prompt, output, cached, max_tokens)
            checks += 1
        proposer.finish(rid)
        if params["max_cached_requests"] and output:
            cached = (cached + [output])[-params["max_cached_requests"] :]
        assert proposer.num_cached_requests == len(cached)
        assert proposer._global.num_nodes == 1 + distinct_substrings(cached, params["max_tree_depth"])
    assert proposer.num_requests == 0
