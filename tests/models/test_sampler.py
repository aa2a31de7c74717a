"""Sampler: exact masks and penalties on hand-made logits, seeding, statistics, logprobs."""

from __future__ import annotations

import pytest
import torch

from sonar.models import sampler as sampler_module
from sonar.models.sampler import (
    Sampler,
    SamplingBatch,
    apply_penalties,
    apply_truncation,
    compute_prompt_logprobs,
    is_plain_greedy,
)
from sonar.sampling_params import SamplingParams as SP

NEG_INF = float("-inf")


def build(params, outputs=None, prompts=None, *, vocab, eos=()):
    outputs = outputs if outputs is not None else [[] for _ in params]
    return SamplingBatch.build(params, outputs, prompts, vocab_size=vocab, eos_token_ids=eos)


def sample(logits, params, outputs=None, prompts=None, *, eos=(), generator=None):
    batch = build(params, outputs, prompts, vocab=logits.shape[1], eos=eos)
    return Sampler(generator)(logits, batch)


def kept(x: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in x]


def test_greedy_is_argmax_and_logits_untouched() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    out = sample(logits, [SP(temperature=0.0)] * 6)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert torch.equal(logits, before)
    assert out.logprobs is None


def test_plain_greedy_fast_path() -> None:
    """Which params may skip the `SamplingBatch`, and that the fast path picks the full path's tokens."""
    plain = [SP(temperature=0.0), SP(temperature=0.0, ignore_eos=True, max_tokens=128, top_p=0.5)]
    not_plain = [
        SP(temperature=0.7),
        SP(temperature=0.0, repetition_penalty=1.2),
        SP(temperature=0.0, presence_penalty=0.5),
        SP(temperature=0.0, frequency_penalty=0.5),
        SP(temperature=0.0, logit_bias={3: 1.0}),
        SP(temperature=0.0, min_tokens=2),
        SP(temperature=0.0, logprobs=0),
    ]
    assert all(is_plain_greedy(p) for p in plain)
    assert not any(is_plain_greedy(p) for p in not_plain)
    logits = torch.randn(5, 70, generator=torch.Generator().manual_seed(9))
    full = sample(logits, [plain[i % 2] for i in range(5)])
    assert torch.equal(Sampler.greedy(logits).sampled_token_ids, full.sampled_token_ids)


def test_top_k_1_is_greedy_in_a_mixed_batch() -> None:
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(2))
    params = [SP(top_k=1, temperature=1.5, seed=i) if i % 2 else SP(top_k=1) for i in range(8)]
    out = sample(logits, params, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def truncate(logits: torch.Tensor, params: list[SP]) -> torch.Tensor:
    batch = build(params, vocab=logits.shape[1])
    x = logits.clone().div_(batch.temperature.unsqueeze(1))
    return apply_truncation(x, batch)


PROBS = torch.tensor([0.05, 0.5, 0.15, 0.3])  # sorted: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)


@pytest.mark.parametrize(
    "params, expected",
    [
        (SP(top_k=1), {1}),
        (SP(top_k=2), {1, 3}),
        (SP(top_k=3), {1, 2, 3}),
        (SP(top_k=4), {0, 1, 2, 3}),
        (SP(top_p=0.4), {1}),
        (SP(top_p=0.75), {1, 3}),
        (SP(top_p=0.9), {1, 2, 3}),
        (SP(top_p=0.99), {0, 1, 2, 3}),
        # top-k first, then top-p over the renormalised rest: 0.5/0.8=0.625, 0.3/0.8=0.375.
        (SP(top_k=2, top_p=0.6), {1}),
        (SP(top_k=2, top_p=0.7), {1, 3}),
        (SP(min_p=0.7), {1}),  # threshold 0.35 of the top probability 0.5
        (SP(min_p=0.25), {1, 2, 3}),
        (SP(min_p=0.09), {0, 1, 2, 3}),
        (SP(), {0, 1, 2, 3}),
    ],
)
@pytest.mark.parametrize("candidates", [1024, 2])
def test_truncation_masks_exactly(
    params: SP, expected: set[int], candidates: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With 2 candidates, top-p sets of three or four tokens take the full-sort fallback.
    monkeypatch.setattr(sampler_module, "TOP_P_CANDIDATES", candidates)
    logits = PROBS.log().unsqueeze(0)
    # The same row beside an untouched one: the other row's settings must not leak.
    both = truncate(logits.repeat(2, 1), [params, SP()])
    assert kept(both) == [expected, {0, 1, 2, 3}]
    assert torch.equal(both[0, sorted(expected)], logits[0, sorted(expected)])


def test_truncation_follows_temperature() -> None:
    logits = PROBS.log().unsqueeze(0)
    # At temperature 2 probabilities flatten to ~[0.11, 0.35, 0.19, 0.27]: 0.75 needs three.
    assert kept(truncate(logits, [SP(top_p=0.75, temperature=2.0)])) == [{1, 2, 3}]


def test_top_p_on_a_large_vocabulary() -> None:
    """Peaked rows find their cutoff among the candidates; a flat row needs the full sort."""
    vocab = 5000
    peaked = torch.full((vocab,), -20.0)
    peaked[:10] = torch.linspace(5.0, 0.0, 10)
    flat = torch.linspace(0.0, -1.0, vocab)  # descending, so the kept set is a prefix
    x = truncate(torch.stack([peaked, flat, peaked]), [SP(top_p=0.9), SP(top_p=0.9), SP()])

    def needed(row: torch.Tensor) -> int:
        mass_before = torch.softmax(row, dim=-1).cumsum(0) - torch.softmax(row, dim=-1)
        return int((mass_before < 0.9).sum())

    assert kept(x)[0] == set(range(needed(peaked))) and needed(peaked) < 10
    assert kept(x)[1] == set(range(needed(flat))) and needed(flat) > 2000
    assert len(kept(x)[2]) == vocab


def test_top_k_keeps_ties_and_mixed_k() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 2.0], [5.0, 4.0, 3.0, 2.0, 1.0]])
    x = truncate(logits, [SP(top_k=1), SP(top_k=3)])
    assert kept(x) == [{1, 2}, {0, 1, 2}]


def test_sampling_only_draws_kept_tokens() -> None:
    logits = PROBS.log().repeat(400, 1)
    params = [SP(top_k=2, seed=i) for i in range(200)] + [SP(top_p=0.75)] * 200
    out = sample(logits, params, generator=torch.Generator().manual_seed(3))
    assert set(out.sampled_token_ids.tolist()) == {1, 3}


def test_penalties_follow_the_formulas() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 4.0]])
    prompt = [[0, 1]]
    output = [[2, 2, 3]]
    params = [SP(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)]
    batch = build(params, output, prompt, vocab=6)
    x = apply_penalties(logits.clone(), batch)
    expected = torch.tensor(
        [
            [
                2.0 / 2,  # prompt token, positive: divided
                -1.0 * 2,  # prompt token, negative: multiplied
                0.5 / 2 - 0.5 * 2 - 0.25,  # output twice
                -3.0 * 2 - 0.5 * 1 - 0.25,  # output once
                1.0,
                4.0,
            ]
        ]
    )
    torch.testing.assert_close(x, expected)


def test_penalties_only_touch_their_rows() -> None:
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(4))
    params = [SP(), SP(presence_penalty=1.0), SP(repetition_penalty=1.5)]
    batch = build(params, [[1, 2], [1, 2], [3]], [[4], [4], [5]], vocab=10)
    x = apply_penalties(logits.clone(), batch)
    assert torch.equal(x[0], logits[0])
    assert torch.equal(x[1, [0, 3, 4, 5]], logits[1, [0, 3, 4, 5]])
    torch.testing.assert_close(x[1, [1, 2]], logits[1, [1, 2]] - 1.0)
    changed = torch.nonzero(x[2] != logits[2]).flatten().tolist()
    assert changed == [3, 5]


def test_repetition_penalty_needs_prompt_ids() -> None:
    with pytest.raises(ValueError, match="prompt_token_ids"):
        build([SP(repetition_penalty=1.2)], [[1]], None, vocab=4)


def test_logit_bias() -> None:
    logits = torch.zeros(2, 8)
    logits[:, 0] = 5.0
    params = [SP(temperature=0, logit_bias={6: 10.0, 2: -3.0}), SP(temperature=0)]
    batch = build(params, vocab=8)
    x = apply_penalties(logits.clone(), batch)
    assert x[0].tolist() == [5.0, 0.0, -3.0, 0.0, 0.0, 0.0, 10.0, 0.0]
    assert torch.equal(x[1], logits[1])
    assert sample(logits, params).sampled_token_ids.tolist() == [6, 0]


def test_min_tokens_blocks_eos_and_stop_token_ids() -> None:
    eos = 3
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0, 8.0]]).repeat(4, 1)
    params = [
        SP(temperature=0, min_tokens=2),
        SP(temperature=0, min_tokens=2, stop_token_ids=[4]),
        SP(temperature=0, min_tokens=2, stop_token_ids=[4], ignore_eos=True),
        SP(temperature=0, min_tokens=2),
    ]
    outputs = [[1], [1], [1], [1, 1]]  # the last row already has its two tokens
    out = sample(logits, params, outputs, eos=[eos])
    assert out.sampled_token_ids.tolist() == [4, 2, 3, 3]


def test_seeded_rows_are_batch_invariant() -> None:
    gen = torch.Generator().manual_seed(5)
    vocab = 64
    row = torch.randn(1, vocab, generator=gen)
    target = SP(seed=1234, temperature=0.9, top_p=0.95)
    alone = [sample(row, [target], [list(range(step))]).sampled_token_ids.item() for step in range(40)]
    assert len(set(alone)) > 5  # the noise changes from one position to the next
    for position, batch_size in [(0, 5), (3, 5), (6, 7)]:
        for step in range(0, 40, 7):
            logits = torch.randn(batch_size, vocab, generator=gen)
            logits[position] = row[0]
            params = [
                SP(seed=99 + i) if i % 3 == 0 else SP(temperature=0) if i % 3 == 1 else SP() for i in range(batch_size)
            ]
            params[position] = target
            outputs = [list(range(i)) for i in range(batch_size)]
            outputs[position] = list(range(step))
            out = sample(logits, params, outputs, generator=torch.Generator().manual_seed(step))
            assert out.sampled_token_ids[position].item() == alone[step]


def test_different_seeds_give_different_streams() -> None:
    logits = torch.zeros(16, 1000)
    out = sample(logits, [SP(seed=s) for s in range(16)])
    assert len(set(out.sampled_token_ids.tolist())) > 12


def expected_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits / temperature, dim=-1)


def assert_close_to(counts: torch.Tensor, probs: torch.Tensor, draws: int) -> None:
    """Each frequency within 5 standard deviations of its probability."""
    freq = counts / draws
    sigma = (probs * (1 - probs) / draws).sqrt()
    assert torch.all((freq - probs).abs() <= 5 * sigma + 1e-4), (freq, probs)


@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.0])
def test_seeded_temperature_sampling_matches_softmax(temperature: float) -> None:
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5, -3.0, 1.5, 0.0])
    draws = 20000
    params = [SP(seed=7, temperature=temperature)] * draws
    # One request's stream: the same seed at positions 0..draws-1 (ranges stand in for the
    # output token lists; only their lengths matter without penalties).
    out = sample(logits.repeat(draws, 1), params, [range(i) for i in range(draws)])
    counts = torch.bincount(out.sampled_token_ids, minlength=8).float()
    assert_close_to(counts, expected_probs(logits, temperature), draws)


def test_unseeded_sampling_matches_softmax() -> None:
    logits = torch.tensor([0.3, -0.2, 1.1, 0.0, 2.0])
    draws = 20000
    generator = torch.Generator().manual_seed(11)
    out = sample(logits.repeat(draws, 1), [SP(temperature=0.8)] * draws, generator=generator)
    counts = torch.bincount(out.sampled_token_ids, minlength=5).float()
    assert_close_to(counts, expected_probs(logits, 0.8), draws)


def test_logprobs_top_n_sorted_and_raw() -> None:
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(5, 30, generator=gen)
    params = [
        SP(logprobs=4, temperature=0.5, repetition_penalty=1.3, seed=1),
        SP(logprobs=0, temperature=0),
        SP(),
        SP(logprobs=2, logit_bias={0: 50.0}, temperature=0),
        SP(logprobs=4, top_k=3, seed=2),
    ]
    out = sample(logits, params, [[1, 2]] * 5, [[3]] * 5, generator=gen)
    lp = out.logprobs
    assert lp is not None
    assert lp.token_ids.shape == lp.logprobs.shape == (5, 5)
    raw = torch.log_softmax(logits, dim=-1)
    sampled = out.sampled_token_ids
    assert torch.equal(lp.token_ids[:, 0], sampled)
    torch.testing.assert_close(lp.logprobs[:, 0], raw.gather(1, sampled[:, None]).squeeze(1))
    top = raw.topk(4, dim=-1)
    assert torch.equal(lp.token_ids[:, 1:], top.indices)
    torch.testing.assert_close(lp.logprobs[:, 1:], top.values)
    assert torch.all(lp.logprobs[:, 1:-1] >= lp.logprobs[:, 2:])
    expected_ranks = (raw > raw.gather(1, sampled[:, None])).sum(-1) + 1
    assert torch.equal(lp.ranks, expected_ranks)
    assert sampled[3].item() == 0 and lp.ranks[3].item() > 1  # biased pick, raw rank reported


def test_prompt_logprobs_match_log_softmax_in_chunks() -> None:
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(11, 40, generator=gen, dtype=torch.bfloat16)
    targets = torch.randint(0, 40, (11,), generator=gen)
    whole = compute_prompt_logprobs(logits, targets, 3)
    chunked = compute_prompt_logprobs(logits, targets, 3, chunk_rows=4)
    raw = torch.log_softmax(logits.float(), dim=-1)
    for result in (whole, chunked):
        expected = raw.gather(1, targets[:, None]).squeeze(1)
        torch.testing.assert_close(result.logprobs[:, 0], expected)
        assert torch.equal(result.token_ids[:, 0], targets)
        assert torch.equal(result.token_ids[:, 1:], raw.topk(3, dim=-1).indices)
    assert torch.equal(whole.ranks, chunked.ranks)
    empty = compute_prompt_logprobs(logits[:0], targets[:0], 2)
    assert empty.token_ids.shape == (0, 3)


def test_padded_vocabulary_slice() -> None:
    """Logits sliced from a padded vocabulary (not contiguous) work and stay untouched."""
    padded = torch.randn(3, 12, generator=torch.Generator().manual_seed(9))
    logits = padded[:, :10]
    before = logits.clone()
    params = [SP(temperature=0, logit_bias={2: 30.0}), SP(presence_penalty=1.0, seed=1), SP()]
    out = sample(logits, params, [[1], [1], [1]])
    assert out.sampled_token_ids[0].item() == 2
    assert torch.equal(logits, before)


def test_logits_shape_is_checked() -> None:
    batch = build([SP()], vocab=10)
    with pytest.raises(ValueError, match="shape"):
        Sampler()(torch.zeros(1, 11), batch)


@pytest.mark.parametrize("seed", [0, -1, 2**63 - 1, -(2**63)])
def test_any_64_bit_seed_works_and_positions_differ(seed: int) -> None:
    from sonar.models.sampler import step_seed

    seeds = {step_seed(seed, position) for position in range(100)}
    assert len(seeds) == 100 and all(0 <= s < 2**64 for s in seeds)
    logits = torch.zeros(1, 100)
    first = sample(logits, [SP(seed=seed)]).sampled_token_ids
    assert torch.equal(first, sample(logits, [SP(seed=seed)]).sampled_token_ids)


def _masked_batch_params() -> list[SP]:
    """One of each sampling path, each with min_tokens so its row can be blocked."""
    return [
        SP(temperature=0.0, min_tokens=1),  # greedy in a mixed batch
        SP(temperature=1.0, min_tokens=1),  # plain random
        SP(temperature=0.8, top_k=5, min_tokens=1),
        SP(temperature=0.8, top_p=0.9, min_tokens=1),
        SP(temperature=0.8, min_p=0.1, min_tokens=1),
        SP(temperature=1.0, seed=7, min_tokens=1),
        SP(temperature=0.9, top_k=3, top_p=0.5, min_p=0.05, seed=3, min_tokens=1),
    ]


@pytest.mark.parametrize("bad_row", range(7))
def test_a_fully_masked_row_fails_alone_with_an_id_in_the_vocabulary(bad_row: int) -> None:
    """min_tokens with stop ids covering the whole vocabulary blocks every token of one row: that
    row fails (id 0, never the vocabulary size), every other row samples what it samples alone."""
    vocab = 64
    params = _masked_batch_params()
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(bad_row))
    everything = list(range(vocab))
    params[bad_row] = SP(
        **{
            **{
                f: getattr(params[bad_row], f) for f in ("temperature", "top_k", "top_p", "min_p", "seed", "min_tokens")
            },
            "stop_token_ids": everything,
        }
    )
    out = sample(logits, params, generator=torch.Generator().manual_seed(5))
    assert out.failed.tolist() == [i == bad_row for i in range(len(params))]
    ids = out.sampled_token_ids
    assert ids.dtype == torch.int64 and 0 <= int(ids.min()) and int(ids.max()) < vocab
    assert int(ids[bad_row]) == 0
    for row, p in enumerate(params):
        if row == bad_row:
            continue
        if p.seed is not None or p.greedy:  # a deterministic row: the same token as alone
            alone = sample(logits[row : row + 1], [p])
            assert int(ids[row]) == int(alone.sampled_token_ids[0]) and not bool(alone.failed[0])


@pytest.mark.parametrize("poison", [float("nan"), NEG_INF])
def test_nan_and_minus_inf_rows_fail_on_every_path(poison: float) -> None:
    """Rows of the model's output that are all -inf, or hold a NaN, fail on the fast greedy path and
    on the full path (greedy, random, truncated, seeded); the other rows are untouched."""
    vocab = 40
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(3))
    if poison != poison:  # NaN: one entry is enough to break the row
        logits[1, 7] = poison
    else:
        logits[1] = poison
    fast = Sampler.greedy(logits)
    assert fast.failed.tolist() == [False, True, False, False]
    assert int(fast.sampled_token_ids[1]) == 0
    assert fast.sampled_token_ids[[0, 2, 3]].tolist() == logits[[0, 2, 3]].argmax(-1).tolist()
    for p in _masked_batch_params():
        p = SP(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, seed=p.seed)
        out = sample(logits, [p] * 4, generator=torch.Generator().manual_seed(1))
        assert out.failed.tolist() == [False, True, False, False], p
        ids = out.sampled_token_ids
        assert int(ids[1]) == 0 and 0 <= int(ids.min()) and int(ids.max()) < vocab


def test_logits_pushed_to_infinity_by_valid_params_are_drawn_not_failed() -> None:
    """A tiny repetition penalty (valid: > 0) divides the seen positive logits into +inf, a tiny
    temperature can too: those tokens take the whole mass instead of failing the row."""
    vocab = 30
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(4))
    logits[:, [3, 5, 8, 9]] = torch.tensor([2.0, 1.0, -1.0, 0.0])  # 0 / 0 would be NaN
    prompts = [[3, 5, 8, 9]] * 3
    params = [
        SP(temperature=1.0, repetition_penalty=5e-324),
        SP(temperature=0.7, top_p=0.9, repetition_penalty=5e-324, seed=1),
        SP(temperature=0.0, repetition_penalty=5e-324),
    ]
    for trial in range(5):
        out = sample(logits, params, prompts=prompts, generator=torch.Generator().manual_seed(trial))
        assert not out.failed.any()
        assert all(t in (3, 5) for t in out.sampled_token_ids.tolist())  # the two positive seen logits
    huge = torch.full((1, vocab), -1.0)
    huge[0, 7] = 3e38  # / temperature 1e-4: +inf
    out = sample(huge, [SP(temperature=1e-4)])
    assert not out.failed.any() and out.sampled_token_ids.tolist() == [7]
    # every token seen and negative, a huge penalty: all at the lowest float, none masked; a tiny
    # temperature then keeps the best of them instead of overflowing the whole row to -inf
    low = -torch.rand(2, vocab, generator=torch.Generator().manual_seed(6)) - 1.0
    low[:, 4] = 0.0  # 0 * inf would be NaN
    seen = [list(range(vocab))] * 2
    out = sample(
        low, [SP(temperature=1e-5, repetition_penalty=1e300), SP(temperature=0, repetition_penalty=1e300)], prompts=seen
    )
    assert not out.failed.any() and 0 <= int(out.sampled_token_ids.max()) < vocab
    # a temperature past float32's range, with min_tokens masking a token: uniform over the others
    out = sample(logits[:1], [SP(temperature=1e300, min_tokens=1, stop_token_ids=[2])], eos=[11])
    assert not out.failed.any() and out.sampled_token_ids.item() not in (2, 11)
