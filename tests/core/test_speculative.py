"""Speculative decoding in the scheduler's core: the settings, the n-gram proposer, and steps with
drafts checked by the fake runner's KV fingerprints (a rejected draft's KV must never be read)."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest

from sonar.core.blocks import BlockManager
from sonar.core.request import Request
from sonar.core.schedule import Scheduler, SchedulerConfig
from sonar.core.speculative import NgramProposer, SpeculativeConfig
from sonar.engine.config import EngineConfig
from tests.core.simulate import FakeRunner

BS = 4
CYCLE = [11, 12, 13, 14, 15, 16]


def spec(**kw: Any) -> SpeculativeConfig:
    return SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, **kw})


def make(num_blocks: int = 64, speculative: SpeculativeConfig | None = None, **config: Any) -> FakeRunner:
    config.setdefault("max_model_len", 128)
    config.setdefault("max_num_batched_tokens", 64)
    config.setdefault("max_num_seqs", 8)
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=True)
    return FakeRunner(Scheduler(SchedulerConfig(speculative=speculative or spec(), **config), bm))


def cyclic(tokens: list[int]) -> int:
    """A "model" that continues the cycle: what followed the last token's latest occurrence."""
    last = tokens[-1]
    return CYCLE[(CYCLE.index(last) + 1) % len(CYCLE)] if last in CYCLE else CYCLE[0]


# Settings.


def test_parse_fills_the_lookup_bounds_as_vllm_does() -> None:
    both = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4})
    assert (both.prompt_lookup_min, both.prompt_lookup_max) == (5, 5)
    one = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (3, 3)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"method": "draft_model", "num_speculative_tokens": 3}, r"needs a model \(--spec-model\)"),
        ({"method": "medusa", "model": "head", "num_speculative_tokens": 3}, "needs a Medusa or MLP-speculator head"),
        ({"method": "eagle3", "num_speculative_tokens": 3}, r"eagle3 needs a model \(--spec-model\)"),
        ({"method": "mtp", "num_speculative_tokens": 1, "model": "x"}, "model: not for method mtp"),
        (
            {"method": "ngram", "num_speculative_tokens": 3, "model": "some/draft"},
            "only for methods draft_model, eagle, eagle3",
        ),
        (
            {"method": "eagle", "model": "h", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2},
            "draft_tensor_parallel_size 2: the eagle head runs whole on the sampler rank, so only 1",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2},
            "draft_tensor_parallel_size 2: method ngram runs no model, so only 1",
        ),
        (
            {"model": "d", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 0},
            "draft_tensor_parallel_size must be a positive integer",
        ),
        ({"method": "ngram", "num_speculative_tokens": 3, "frobnicate": 1}, "unknown or unsupported key"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive"),
        ({"method": "lookahead", "num_speculative_tokens": 2}, "method must be one of"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "must not exceed",
        ),
        ({"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_min_token_prob": 2}, r"in \[0, 1\]"),
    ],
)
def test_bad_settings_are_refused_by_name(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(raw)


def test_a_draft_model_splits_over_the_targets_tensor_ranks_unless_told_one() -> None:
    """vLLM's rule: 1 or the target's tensor-parallel size, the target's when unset."""
    draft = SpeculativeConfig.parse({"model": "d", "num_speculative_tokens": 3})
    assert draft.draft_tensor_parallel_size is None
    assert [draft.draft_tp(tp, 1) for tp in (1, 2, 4)] == [1, 2, 4]
    assert draft.draft_tp(2, 2) == 1  # several stages: whole on the sampler
    one = SpeculativeConfig.parse({"model": "d", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1})
    assert (one.draft_tp(2, 1), one.draft_tp(2, 2)) == (1, 1)
    two = SpeculativeConfig.parse({"model": "d", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2})
    assert two.draft_tp(2, 1) == 2
    with pytest.raises(
        ValueError, match="draft_tensor_parallel_size 2 is not allowed: it must be 1 .* --tensor-parallel-size 4"
    ):
        two.draft_tp(4, 1)
    with pytest.raises(ValueError, match="draft_tensor_parallel_size 2 with --pipeline-parallel-size 2"):
        two.draft_tp(2, 2)
    head = SpeculativeConfig.parse({"method": "eagle3", "model": "h", "num_speculative_tokens": 3})
    assert head.draft_tp(4, 1) == 1  # heads run whole on the sampler


def test_a_draft_tensor_parallel_size_the_group_cannot_take_is_a_startup_error() -> None:
    def config(size: int | None, **args: Any) -> EngineConfig:
        spec = {"model": "tiny", "num_speculative_tokens": 2, "draft_tensor_parallel_size": size}
        return EngineConfig.from_args(speculative_config=spec, **args)

    with pytest.raises(ValueError, match="draft_tensor_parallel_size 3 is not allowed.*--tensor-parallel-size 2"):
        config(3, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="draft_tensor_parallel_size 2 is not allowed.*--tensor-parallel-size 1"):
        config(2)
    assert config(2, tensor_parallel_size=2).speculative().draft_tp(2, 1) == 2
    assert config(1, tensor_parallel_size=2).speculative().draft_tp(2, 1) == 1
    assert config(None, tensor_parallel_size=2, pipeline_parallel_size=2).speculative().draft_tp(2, 2) == 1


def test_engine_flags_merge_into_the_config_and_conflicts_are_refused() -> None:
    config = EngineConfig.from_args(speculative_config='{"method": "ngram"}', spec_tokens=3)
    assert config.speculative().num_speculative_tokens == 3
    with pytest.raises(ValueError, match="--spec-method 'suffix' differs from --speculative-config.method"):
        EngineConfig.from_args(
            speculative_config={"method": "ngram", "num_speculative_tokens": 2}, spec_method="suffix"
        )
    assert EngineConfig.from_args(spec_method="ngram", spec_tokens=2, async_scheduling=True).speculative()
    assert EngineConfig.from_args(spec_method="suffix", spec_tokens=2, async_scheduling=True).speculative()
    assert EngineConfig.from_args(spec_model="tiny", spec_tokens=2, async_scheduling=True).speculative()
    assert EngineConfig.from_args(spec_model="tiny", spec_tokens=2, async_scheduling=True, tensor_parallel_size=2)
    assert EngineConfig.from_args(spec_method="ngram", spec_tokens=2, tensor_parallel_size=2).speculative()
    assert EngineConfig.from_args(spec_model="tiny", spec_tokens=2, tensor_parallel_size=2).speculative()
    assert EngineConfig.from_args(spec_model="tiny", spec_tokens=2, pipeline_parallel_size=2).speculative()
    for method in ("eagle", "eagle3"):
        assert EngineConfig.from_args(spec_method=method, spec_model="head", spec_tokens=2, tensor_parallel_size=2)
    assert EngineConfig.from_args(spec_method="mtp", spec_tokens=2, pipeline_parallel_size=2).speculative()
    assert EngineConfig.from_args(spec_method="eagle3", spec_model="head", spec_tokens=2, pipeline_parallel_size=2)
    assert EngineConfig.from_args(spec_tokens=2, spec_model="tiny").speculative().method == "draft_model"
    with pytest.raises(ValueError, match="speculative method draft_model with KV offloading"):
        EngineConfig.from_args(spec_tokens=2, spec_model="tiny", kv_offloading_size=1)
    assert EngineConfig.from_args().speculative() is None


# The n-gram proposer.


def reference_ngram(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        pattern = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == pattern:
                return tokens[start + n : start + n + k]
    return []


def test_ngram_proposes_what_followed_the_latest_match_longest_first() -> None:
    proposer = NgramProposer(3, 1, 3)
    # "5 6" occurs twice before the end; the latest match of the longest suffix "4 5 6" wins
    assert proposer.propose("a", [5, 6, 1, 4, 5, 6, 2, 3, 9, 4, 5, 6], [], 3) == [2, 3, 9]
    assert proposer.propose("b", [1, 2, 3], [4], 3) == []
    assert proposer.propose("c", [7, 8, 7, 8], [], 1) == [7]  # capped by the caller's room


def test_ngram_matches_whole_tokens_only_and_agrees_with_a_reference() -> None:
    """The search runs over the tokens' bytes: a match must start at a token boundary."""
    rng = random.Random(0)
    alphabet = [1, 256, 65536, 16777216, 257, 0, 2**31 - 1]
    for trial in range(400):
        tokens = [rng.choice(alphabet[: rng.randint(2, len(alphabet))]) for _ in range(rng.randint(2, 40))]
        cut = rng.randint(1, len(tokens))
        proposer = NgramProposer(4, 1, 3)
        # fed incrementally, as the core does while the output grows
        proposer.propose(str(trial), tokens[:cut], [], 4)
        got = proposer.propose(str(trial), tokens[:cut], tokens[cut:], 4)
        assert got == reference_ngram(tokens, 4, 1, 3), tokens


# Steps with drafts.


def test_a_repeating_request_gets_drafts_and_keeps_those_the_model_agrees_with() -> None:
    runner = make()
    prompt = CYCLE * 3
    runner.add(Request("r", prompt, max_tokens=20))
    runner.step(model=cyclic)  # the prefill samples one token
    out, updates = runner.step(model=cyclic)
    [sched] = out.requests
    assert sched.num_drafts == 3 and sched.token_ids == [11, 12, 13, 14]
    assert updates[0].new_token_ids == [12, 13, 14, 15]  # three drafts and the token after them
    request = runner.scheduler.get_request("r")
    assert request.num_computed_tokens == request.num_tokens - 1
    while runner.scheduler.has_unfinished_requests():
        runner.step(model=cyclic)
    stats = runner.scheduler.stats()
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0
    per_position = stats.spec_accepted_per_position
    assert len(per_position) == 3 and per_position[0] == stats.spec_num_drafts  # the last step has fewer drafts
    assert runner.scheduler.block_manager.num_free_blocks == 64


def test_rejected_drafts_roll_back_and_their_kv_is_overwritten() -> None:
    """The model leaves the cycle at output 4: drafts there are rejected, and every later step
    reads only KV of the tokens kept (the fake runner checks each read)."""
    runner = make()
    prompt = CYCLE * 2

    def model(tokens: list[int]) -> int:
        return 99 if len(tokens) == len(prompt) + 4 else cyclic(tokens)

    runner.add(Request("r", prompt, max_tokens=16))
    outputs: list[int] = []
    while runner.scheduler.has_unfinished_requests():
        _, updates = runner.step(model=model)
        for update in updates:
            outputs += update.new_token_ids
    expected: list[int] = []
    seq = list(prompt)
    for _ in range(16):
        seq.append(model(seq))
        expected.append(seq[-1])
    assert outputs == expected
    stats = runner.scheduler.stats()
    assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


def test_drafts_stay_within_max_tokens_max_model_len_and_the_budget() -> None:
    runner = make(max_model_len=24, max_num_batched_tokens=8, max_num_seqs=4)
    runner.add(Request("short", CYCLE * 2, max_tokens=3))
    runner.add(Request("long", [CYCLE[0]] + CYCLE * 3, max_tokens=100))
    tokens: dict[str, int] = {"short": 0, "long": 0}
    while runner.scheduler.has_unfinished_requests():
        out, updates = runner.step(model=cyclic)
        assert out.num_scheduled_tokens <= 8
        for update in updates:
            tokens[update.req_id] += len(update.new_token_ids)
    assert tokens == {"short": 3, "long": 24 - 19}


def test_a_grammar_cuts_drafts_and_none_run_above_disable_by_batch_size() -> None:
    class OneAhead:
        """Allows any token, but drafts only one token ahead."""

        def accept_token(self, token: int) -> bool:
            return True

        def is_terminated(self) -> bool:
            return False

        def valid_prefix(self, tokens: list[int]) -> int:
            return min(1, len(tokens))

    runner = make()
    runner.add(Request("g", CYCLE * 2, max_tokens=8, grammar=OneAhead()))
    drafts = []
    while runner.scheduler.has_unfinished_requests():
        out, _ = runner.step(model=cyclic)
        drafts += [r.num_drafts for r in out.requests if r.sample]
    assert set(drafts) == {0, 1} and drafts.count(1) >= 2

    runner = make(speculative=spec(disable_by_batch_size=2))
    for name in "ab":
        runner.add(Request(name, CYCLE * 2, max_tokens=6))
    while runner.scheduler.has_unfinished_requests():
        out, _ = runner.step(model=cyclic)
        assert all(r.num_drafts == 0 for r in out.requests) or len(runner.scheduler.running) < 2


def test_preemption_and_a_worker_crash_with_drafts_lose_no_token() -> None:
    """A cache too small for all four: requests with drafts are preempted and recomputed, and a
    crash in the middle recomputes everything; each output is what the model says."""
    runner = make(num_blocks=14, max_model_len=48)
    prompts = {name: [CYCLE[i]] + CYCLE * 2 for i, name in enumerate("abcd")}
    outputs: dict[str, list[int]] = {name: [] for name in prompts}
    for name, prompt in prompts.items():
        runner.add(Request(name, prompt, max_tokens=12))
    steps = 0
    while runner.scheduler.has_unfinished_requests():
        steps += 1
        if steps == 6:
            runner.crash()
            runner.scheduler.reset_after_worker_failure()
            runner.scheduler.check_invariants()
            continue
        _, updates = runner.step(model=cyclic)
        for update in updates:
            outputs[update.req_id] += update.new_token_ids
    for name, prompt in prompts.items():
        seq = list(prompt)
        for _ in range(12):
            seq.append(cyclic(seq))
        assert outputs[name] == seq[len(prompt) :], name
    assert runner.scheduler.num_preemptions > 0
    assert runner.scheduler.stats().spec_num_accepted_tokens > 0


def test_a_draft_models_proposals_run_in_the_next_step_with_room_for_its_lookahead() -> None:
    """With a draft model the worker proposes: its drafts come back with a step's tokens and ride
    in the request's next step, whose blocks hold ``k`` more slots for the draft's own KV."""
    draft = SpeculativeConfig.parse({"method": "draft_model", "model": "draft", "num_speculative_tokens": 3})
    assert draft.lookahead == 3
    runner = make(speculative=draft, max_model_len=40)
    scheduler = runner.scheduler
    runner.add(Request("r", CYCLE * 2, max_tokens=30))
    seq = list(CYCLE * 2)
    proposals = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        scheduler.check_invariants()
        runner.check_output(out)
        for sched in out.requests:
            end = sched.start_pos + len(sched.token_ids)
            if sched.sample:  # room for the draft's lookahead, within max_model_len
                assert len(sched.block_ids) * BS >= min(end + 3, 40)
        sampled = runner.execute(out, model=cyclic)
        seq += sampled.get("r", [])
        guess = [cyclic(seq)]
        while len(guess) < 3:
            guess.append(cyclic(seq + guess))
        if proposals % 3 == 2:
            guess[1] = 99  # a wrong guess now and then
        proposals += 1
        for update in scheduler.update_from_output(sampled, {"r": guess}):
            runner.tokens[update.req_id] += update.new_token_ids
    expected = list(CYCLE * 2)
    while len(expected) < 12 + 28:  # max_model_len ends it
        expected.append(cyclic(expected))
    assert seq == expected
    stats = scheduler.stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert scheduler.block_manager.num_free_blocks == 64


def test_a_request_whose_drafts_miss_proposes_less_and_less_often() -> None:
    """A model that never follows the cycle: after each all-rejected step the request waits 1, 2, 4
    .. 16 decode steps before drafting again; once the model follows the cycle, drafts run each step."""
    runner = make()
    runner.add(Request("r", CYCLE * 3, max_tokens=100))
    drafted: list[bool] = []

    def model(tokens: list[int]) -> int:
        if len(tokens) >= len(CYCLE) * 3 + 60:
            return cyclic(tokens)
        guess = reference_ngram(tokens, 1, 2, 2)  # what the proposer drafts first: never that
        return guess[0] % 7 + 1 if guess else 1

    while runner.scheduler.has_unfinished_requests():
        out, _ = runner.step(model=model)
        drafted += [r.num_drafts > 0 for r in out.requests if r.sample]
    misses = drafted[:60]
    gaps = [b - a - 1 for a, b in itertools.pairwise([i for i, d in enumerate(misses) if d])]
    # (a gap may be longer: a step where nothing matches proposes nothing)
    assert len(gaps) >= 4 and all(gap >= wait for gap, wait in zip(gaps, [1, 2, 4, 8, 16, 16]))
    assert sum(misses) <= 8
    assert all(drafted[-5:]), "".join(".d"[d] for d in drafted)  # agreeing again: drafts every step


def test_drafts_stop_short_of_the_longrope_switch() -> None:
    """A sequence on LongRoPE's short factors verifies no draft past the original context (the
    fake runner checks every short step ends within it); the decode that crosses recomputes the
    sequence with the long factors, and the drafts go on from there."""
    runner = make(longrope_switch=20)
    prompt = CYCLE * 3
    runner.add(Request("r", prompt, max_tokens=12))
    outputs: list[int] = []
    long_drafts = 0
    while runner.scheduler.has_unfinished_requests():
        out, updates = runner.step(model=cyclic)
        long_drafts += sum(r.num_drafts for r in out.requests if r.long_rope)
        for update in updates:
            outputs += update.new_token_ids
    seq = list(prompt)
    for _ in range(12):
        seq.append(cyclic(seq))
    assert outputs == seq[len(prompt) :]
    assert runner.scheduler.num_preemptions == 1 and long_drafts > 0
