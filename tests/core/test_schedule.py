import itertools
import sys
from collections.abc import Sequence
from typing import Any

import msgspec
import pytest

from sonar.core.blocks import BlockManager
from sonar.core.outputs import PLACEHOLDER_TOKEN, RequestError, SchedulerOutput
from sonar.core.request import (
    DuplicateRequestError,
    LoRARequest,
    PromptTooLongError,
    Request,
    RequestRejectedError,
    RequestStatus,
)
from sonar.core.schedule import Scheduler, SchedulerConfig
from tests.core.simulate import FakeRunner

BS = 4


def make_runner(num_blocks: int = 64, *, prefix_caching: bool = True, **config: Any) -> tuple[Scheduler, FakeRunner]:
    config.setdefault("max_model_len", 64)
    config.setdefault("max_num_batched_tokens", 64)
    config.setdefault("max_num_seqs", 8)
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=prefix_caching)
    scheduler = Scheduler(SchedulerConfig(**config), bm)
    return scheduler, FakeRunner(scheduler)


_bases = itertools.count(1)


def req(request_id: str, prompt: Sequence[int] | int, **kwargs: Any) -> Request:
    """A request; an int prompt means that many tokens no other request shares."""
    if isinstance(prompt, int):
        base = 10_000 * next(_bases)
        tokens = list(range(base, base + prompt))
    else:
        tokens = list(prompt)
    kwargs.setdefault("max_tokens", 4)
    return Request(request_id, tokens, **kwargs)


def chunks(out: SchedulerOutput) -> dict[str, tuple[int, int]]:
    """req_id -> (start position, number of tokens) of one step."""
    return {r.req_id: (r.start_pos, len(r.token_ids)) for r in out.requests}


def assert_all_free(scheduler: Scheduler) -> None:
    scheduler.check_invariants()
    bm = scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not scheduler.running and not len(scheduler.waiting)


# Budget, order and chunking.


def test_decodes_go_before_prefills_and_budget_is_respected() -> None:
    scheduler, runner = make_runner(max_num_batched_tokens=16)
    runner.add(req("a", 5, max_tokens=10))
    runner.add(req("b", 6, max_tokens=10))
    out, _ = runner.step()
    assert chunks(out) == {"a": (0, 5), "b": (0, 6)}
    runner.add(req("long", 40, max_tokens=2))
    out, _ = runner.step()
    assert list(chunks(out)) == ["a", "b", "long"]
    assert chunks(out) == {"a": (5, 1), "b": (6, 1), "long": (0, 14)}
    assert out.num_scheduled_tokens == 16
    assert [r.sample for r in out.requests] == [True, True, False]
    assert [r.is_new for r in out.requests] == [False, False, True]
    # The running prefill continues after the decodes, behind them in the step.
    out, _ = runner.step()
    assert chunks(out) == {"a": (6, 1), "b": (7, 1), "long": (14, 14)}
    runner.drain()
    assert_all_free(scheduler)


def test_a_decode_goes_before_a_more_important_running_prefill() -> None:
    scheduler, runner = make_runner(max_num_batched_tokens=8, scheduling_policy="priority")
    runner.add(req("young", 3, max_tokens=10, priority=1))
    runner.step()
    runner.add(req("old", 40, priority=0))
    out, _ = runner.step()
    assert [r.request_id for r in scheduler.running] == ["old", "young"]
    assert list(chunks(out)) == ["young", "old"] and chunks(out)["old"] == (0, 7)
    out, _ = runner.step()
    assert list(chunks(out)) == ["young", "old"] and chunks(out)["old"] == (7, 7)
    runner.drain()
    assert_all_free(scheduler)


def test_chunked_prefill_sequence() -> None:
    scheduler, runner = make_runner(max_num_batched_tokens=8)
    runner.add(req("a", 30, max_tokens=2))
    starts = []
    for _ in range(4):
        out, updates = runner.step()
        ((start, n),) = chunks(out).values()
        starts.append((start, n, out.requests[0].sample))
    assert starts == [(0, 8, False), (8, 8, False), (16, 8, False), (24, 6, True)]
    assert [u.new_token_ids for u in updates] == [[7]]
    out, updates = runner.step()
    assert chunks(out) == {"a": (30, 1)}
    assert updates[0].finish_reason == "length"
    assert_all_free(scheduler)


def test_long_prefill_threshold_caps_chunks() -> None:
    scheduler, runner = make_runner(max_num_batched_tokens=32, long_prefill_token_threshold=5)
    runner.add(req("a", 12, max_tokens=1))
    runner.add(req("b", 3, max_tokens=1))
    out, _ = runner.step()
    assert chunks(out) == {"a": (0, 5), "b": (0, 3)}
    out, _ = runner.step()
    assert chunks(out) == {"a": (5, 5)}
    out, _ = runner.step()
    assert chunks(out) == {"a": (10, 2)}
    assert_all_free(scheduler)


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits() -> None:
    scheduler, runner = make_runner(max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False)
    runner.add(req("a", 4, max_tokens=3))
    runner.step()
    runner.add(req("big", 16, max_tokens=1))
    runner.add(req("small", 2, max_tokens=1))
    out, _ = runner.step()
    # 15 tokens of budget are left, "big" needs 16; first come first served, so "small" waits too.
    assert chunks(out) == {"a": (4, 1)}
    out, _ = runner.step()
    assert chunks(out) == {"a": (5, 1)}
    out, _ = runner.step()
    assert chunks(out) == {"big": (0, 16)}
    out, _ = runner.step()
    assert chunks(out) == {"small": (0, 2)}
    assert_all_free(scheduler)


def test_max_num_seqs_is_respected() -> None:
    scheduler, runner = make_runner(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(5):
        runner.add(req(f"r{i}", 3, max_tokens=3))
    out, _ = runner.step()
    assert list(chunks(out)) == ["r0", "r1"]
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 3)
    seen_max = 0
    while scheduler.has_unfinished_requests():
        out, _ = runner.step()
        seen_max = max(seen_max, len(out.requests), scheduler.num_running)
    assert seen_max == 2
    assert_all_free(scheduler)


# Prefix caching.


def test_prefix_hit_skips_computed_tokens() -> None:
    scheduler, runner = make_runner()
    shared = list(range(16))
    runner.add(req("a", shared + [100, 101, 102], max_tokens=1))
    runner.drain()
    runner.add(req("b", shared + [200, 201], max_tokens=1))
    out, updates = runner.step()
    assert chunks(out) == {"b": (16, 2)}
    assert out.requests[0].token_ids == [200, 201]
    assert updates[0].num_cached_tokens == 16 and updates[0].num_prompt_tokens == 18
    stats = scheduler.stats()
    assert (stats.prefix_queries, stats.prefix_hits) == (19 + 18, 16)
    assert_all_free(scheduler)


def test_fully_cached_prompt_still_computes_its_last_token() -> None:
    scheduler, runner = make_runner()
    runner.add(req("a", range(8), max_tokens=1))
    runner.drain()
    runner.add(req("b", range(8), max_tokens=1))
    out, _ = runner.step()
    assert chunks(out) == {"b": (4, 4)}
    runner.add(req("c", range(9), max_tokens=1))
    out, _ = runner.step()
    assert chunks(out) == {"c": (8, 1)}
    assert_all_free(scheduler)


def test_siblings_share_the_prompt_in_the_same_step() -> None:
    scheduler, runner = make_runner()
    prompt = list(range(50, 60))
    for i in range(3):
        runner.add(req(f"n-{i}", prompt, max_tokens=3))
    out, _ = runner.step()
    assert chunks(out) == {"n-0": (0, 10), "n-1": (8, 2), "n-2": (8, 2)}
    tables = [r.block_ids for r in out.requests]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert scheduler.block_manager.num_free_blocks == 64 - 5
    tokens = iter(range(300, 400))
    runner.step(sample=lambda _: next(tokens))
    runner.drain()
    assert_all_free(scheduler)


def test_salted_requests_do_not_share() -> None:
    scheduler, runner = make_runner()
    runner.add(req("a", range(12), max_tokens=1, cache_salt="x"))
    runner.drain()
    runner.add(req("b", range(12), max_tokens=1, cache_salt="y"))
    runner.add(req("c", range(12), max_tokens=1, cache_salt="x"))
    out, _ = runner.step()
    assert chunks(out) == {"b": (0, 12), "c": (8, 4)}
    assert_all_free(scheduler)


def test_prefix_caching_off() -> None:
    scheduler, runner = make_runner(prefix_caching=False)
    runner.add(req("a", range(12), max_tokens=1))
    runner.drain()
    runner.add(req("b", range(12), max_tokens=1))
    out, _ = runner.step()
    assert chunks(out) == {"b": (0, 12)}
    assert scheduler.stats().prefix_queries == 0
    assert_all_free(scheduler)


# Preemption.


def preemption_setup(policy: str, priorities: Sequence[int]) -> tuple[Scheduler, FakeRunner]:
    """Three 8-token prompts fill a 6-block cache; the first decode needs a 7th block."""
    scheduler, runner = make_runner(num_blocks=6, max_model_len=24, max_num_batched_tokens=32, scheduling_policy=policy)
    for name, priority in zip("abc", priorities):
        runner.add(req(name, 8, max_tokens=6, priority=priority, arrival_time=0.0))
    out, _ = runner.step()
    assert sorted(chunks(out)) == ["a", "b", "c"]
    assert scheduler.block_manager.num_free_blocks == 0
    return scheduler, runner


def test_fcfs_preempts_the_newest_request() -> None:
    scheduler, runner = preemption_setup("fcfs", [0, 0, 0])
    out, _ = runner.step()
    assert out.preempted_req_ids == ["c"]
    assert chunks(out) == {"a": (8, 1), "b": (8, 1)}
    c = scheduler.get_request("c")
    assert c is not None and c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and scheduler.stats().num_preemptions == 1
    assert scheduler.waiting.peek() is c
    runner.drain()
    assert_all_free(scheduler)


def test_priority_preempts_the_largest_priority_value() -> None:
    scheduler, runner = preemption_setup("priority", [1, 5, 0])
    out, _ = runner.step()
    assert out.preempted_req_ids == ["b"]
    assert list(chunks(out)) == ["c", "a"]
    runner.drain()
    assert_all_free(scheduler)


def test_priority_ties_preempt_the_later_arrival() -> None:
    scheduler, runner = make_runner(
        num_blocks=6, max_model_len=24, max_num_batched_tokens=32, scheduling_policy="priority"
    )
    runner.add(req("late", 8, max_tokens=6, priority=2, arrival_time=30.0))
    runner.add(req("early", 8, max_tokens=6, priority=2, arrival_time=10.0))
    runner.add(req("urgent", 8, max_tokens=6, priority=0, arrival_time=20.0))
    out, _ = runner.step()
    assert list(chunks(out)) == ["urgent", "early", "late"]
    out, _ = runner.step()
    assert out.preempted_req_ids == ["late"]
    runner.drain()
    assert_all_free(scheduler)


def test_preempting_a_request_already_in_the_step_takes_it_out() -> None:
    # "b" decodes in the first pass; "a" continues a chunked prefill in the second pass,
    # runs out of blocks and preempts "b", which was already in the step.
    scheduler, runner = make_runner(
        num_blocks=12,
        max_model_len=48,
        max_num_batched_tokens=16,
        scheduling_policy="priority",
        scheduler_reserve_full_isl=False,
    )
    runner.add(req("b", 16, max_tokens=8, priority=1))
    runner.step()
    runner.add(req("a", 44, max_tokens=1, priority=0))
    out, _ = runner.step()
    assert chunks(out) == {"b": (16, 1), "a": (0, 15)}
    assert scheduler.block_manager.num_free_blocks == 3
    out, _ = runner.step()
    assert out.preempted_req_ids == ["b"]
    assert chunks(out) == {"a": (15, 15)} and out.num_scheduled_tokens == 15
    b = scheduler.get_request("b")
    assert b is not None and b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0 and b.num_tokens == 18
    runner.drain()
    assert_all_free(scheduler)


def test_a_step_that_preempts_admits_nobody() -> None:
    scheduler, runner = make_runner(
        num_blocks=5, max_model_len=20, max_num_batched_tokens=32, scheduling_policy="priority"
    )
    runner.add(req("a", 8, max_tokens=4, priority=1))
    runner.add(req("c", 12, max_tokens=4, priority=2))
    runner.step()
    runner.add(req("d", 2, max_tokens=1, priority=0))
    out, _ = runner.step()
    assert out.preempted_req_ids == ["c"]
    assert chunks(out) == {"a": (8, 1)}
    assert scheduler.block_manager.num_free_blocks == 2  # d would fit, but memory is tight
    assert [r.request_id for r in scheduler.waiting] == ["d", "c"]
    out, _ = runner.step()
    assert chunks(out) == {"a": (9, 1), "d": (0, 2)}
    runner.drain()
    assert_all_free(scheduler)


def test_a_request_that_cannot_grow_preempts_itself_when_last() -> None:
    scheduler, runner = make_runner(num_blocks=4, max_model_len=16, max_num_batched_tokens=16)
    runner.add(req("a", 6, max_tokens=8))
    runner.add(req("b", 8, max_tokens=8))
    out, _ = runner.step()
    assert scheduler.block_manager.num_free_blocks == 0
    # a: 6 -> 7 tokens fits block 1; b: needs a 3rd block at position 8: b preempts itself.
    out, _ = runner.step()
    assert out.preempted_req_ids == ["b"]
    assert chunks(out) == {"a": (6, 1)}
    runner.drain()
    assert_all_free(scheduler)


def test_watermark_keeps_blocks_free_at_admission() -> None:
    scheduler, runner = make_runner(num_blocks=10, max_model_len=40, watermark=0.2)
    runner.add(req("a", 12, max_tokens=20))
    runner.add(req("b", 16, max_tokens=1))
    out, _ = runner.step()
    # a takes 3 blocks; b needs 4 more and would leave 3 >= 2 free: admitted.
    assert sorted(chunks(out)) == ["a", "b"]
    runner.step()
    runner.add(req("c", 20, max_tokens=1))  # 5 blocks: 10 - 4 (a) - 5 = 1 < 2 free
    out, _ = runner.step()
    assert "c" not in chunks(out)
    runner.drain()
    assert_all_free(scheduler)


def test_watermark_is_waived_when_nothing_runs() -> None:
    scheduler, runner = make_runner(num_blocks=10, max_model_len=40, watermark=0.5)
    runner.add(req("a", 36, max_tokens=1))
    out, _ = runner.step()
    assert chunks(out) == {"a": (0, 36)}
    assert_all_free(scheduler)


@pytest.mark.parametrize("reserve", [True, False])
def test_reserve_full_input(reserve: bool) -> None:
    scheduler, runner = make_runner(
        num_blocks=10,
        max_model_len=40,
        max_num_batched_tokens=8,
        long_prefill_token_threshold=4,
        scheduler_reserve_full_isl=reserve,
    )
    runner.add(req("a", 20, max_tokens=1))  # 4 tokens (1 block) a step
    runner.step()
    runner.add(req("b", 36, max_tokens=1))  # first chunk: 1 block; full input: 9 blocks
    out, _ = runner.step()
    assert chunks(out) == ({"a": (4, 4)} if reserve else {"a": (4, 4), "b": (0, 4)})
    runner.drain()
    assert_all_free(scheduler)


# Finishing and aborting.


def test_stop_tokens_min_tokens_and_lengths() -> None:
    scheduler, runner = make_runner(max_model_len=10)
    runner.add(req("stop", 3, max_tokens=10, stop_token_ids=[7], min_tokens=2))
    runner.add(req("len", 3, max_tokens=2))
    runner.add(req("ctx", 8, max_tokens=50))
    _, updates = runner.step()
    by_id = {u.req_id: u for u in updates}
    assert by_id["stop"].finish_reason is None  # the stop token 7 came before min_tokens
    _, updates = runner.step()
    by_id = {u.req_id: u for u in updates}
    assert (by_id["stop"].finish_reason, by_id["stop"].stop_reason) == ("stop", 7)
    assert by_id["stop"].new_token_ids == [7]
    assert by_id["len"].finish_reason == "length"
    assert by_id["ctx"].finish_reason == "length"  # 8 prompt + 2 outputs = max_model_len
    out, _ = runner.step()
    assert sorted(out.finished_req_ids) == ["ctx", "len", "stop"]
    assert_all_free(scheduler)


def test_multiple_sampled_tokens_stop_at_the_first_stop_token() -> None:
    scheduler, _ = make_runner()
    scheduler.add_request(req("a", 3, max_tokens=10, stop_token_ids=[9]))
    scheduler.schedule()
    (update,) = scheduler.update_from_output({"a": [1, 9, 2, 3]})
    assert update.new_token_ids == [1, 9] and update.finish_reason == "stop"
    assert_all_free(scheduler)


def test_stop_found_downstream() -> None:
    scheduler, runner = make_runner()
    runner.add(req("a", 3, max_tokens=10))
    runner.add(req("b", 3, max_tokens=10))
    runner.step()
    request_a = scheduler.requests["a"]
    _, updates = runner.step(stopped={"a": "\n\n"})
    assert [u.finish_reason for u in updates] == [None, None]
    assert (request_a.status, request_a.stop_reason) == (RequestStatus.FINISHED_STOPPED, "\n\n")
    assert "a" not in scheduler.requests and [r.request_id for r in scheduler.running] == ["b"]
    assert scheduler.finish_requests(["b"], RequestStatus.FINISHED_STOPPED, "END") == ["b"]
    runner.forget("b")
    assert_all_free(scheduler)


def test_abort_at_every_stage() -> None:
    scheduler, runner = make_runner(num_blocks=6, max_model_len=24, max_num_batched_tokens=32, max_num_seqs=3)
    for name in ("run", "victim", "third", "queued"):
        runner.add(req(name, 8, max_tokens=6))
    runner.step()
    out, _ = runner.step()
    assert out.preempted_req_ids == ["third"]
    statuses = {r.request_id: r.status for r in scheduler.requests.values()}
    assert statuses == {
        "run": RequestStatus.RUNNING,
        "victim": RequestStatus.RUNNING,
        "third": RequestStatus.PREEMPTED,
        "queued": RequestStatus.WAITING,
    }
    assert scheduler.abort(["run", "third", "queued", "unknown"]) == ["run", "third", "queued"]
    for name in ("run", "third", "queued"):
        runner.forget(name)
    scheduler.check_invariants()
    assert scheduler.num_running == 1 and scheduler.num_waiting == 0
    out, _ = runner.step()
    assert sorted(out.finished_req_ids) == ["queued", "run", "third"]
    assert scheduler.abort(["run"]) == []
    # Results for an aborted request that arrive late are ignored.
    assert scheduler.update_from_output({"run": [1]}) == []
    runner.drain()
    assert_all_free(scheduler)


def test_abort_between_schedule_and_update() -> None:
    scheduler, _ = make_runner()
    scheduler.add_request(req("a", 5))
    scheduler.schedule()
    scheduler.abort(["a"])
    assert scheduler.update_from_output({"a": [3]}) == []
    assert scheduler.schedule().finished_req_ids == ["a"]
    assert_all_free(scheduler)


# Admission errors and configuration.


def test_too_long_prompt_is_rejected_before_queueing() -> None:
    scheduler, _ = make_runner(max_model_len=16)
    message = "17 tokens, more than the maximum model length of 16"
    with pytest.raises(PromptTooLongError, match=message) as info:
        scheduler.add_request(req("x", 17))
    assert (info.value.prompt_len, info.value.max_model_len, info.value.request_id) == (17, 16, "x")
    assert isinstance(info.value, ValueError)
    assert not scheduler.has_unfinished_requests()
    scheduler.add_request(req("x", 16))


def test_bad_requests() -> None:
    scheduler, _ = make_runner()
    scheduler.add_request(req("x", 3))
    with pytest.raises(DuplicateRequestError, match="'x'"):
        scheduler.add_request(req("x", 3))
    with pytest.raises(RequestRejectedError, match="empty"):
        req("y", [])
    with pytest.raises(RequestRejectedError, match="max_tokens"):
        req("y", 3, max_tokens=0)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"max_model_len": 0}, "max_model_len must be a positive integer"),
        ({"max_model_len": 8, "watermark": 1.0}, "watermark"),
        ({"max_model_len": 8, "scheduling_policy": "lifo"}, "unknown scheduling policy 'lifo'"),
        ({"max_model_len": 8, "long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
        (
            {"max_model_len": 8, "max_num_batched_tokens": 4, "max_num_seqs": 8},
            "at least max_num_seqs",
        ),
        (
            {
                "max_model_len": 64,
                "max_num_batched_tokens": 32,
                "max_num_seqs": 4,
                "enable_chunked_prefill": False,
            },
            "without chunked prefill",
        ),
        ({"max_model_len": 64, "longrope_switch": 0}, "longrope_switch must be a positive integer"),
    ],
)
def test_config_validation(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**config)


def test_max_model_len_must_fit_the_cache() -> None:
    with pytest.raises(ValueError, match="needs 5 KV blocks"):
        Scheduler(
            SchedulerConfig(max_model_len=20, max_num_batched_tokens=32, max_num_seqs=4),
            BlockManager(4, BS),
        )


# LongRoPE: the factor set of each sequence (`SchedulerConfig.longrope_switch`).


def test_a_prompt_past_the_longrope_switch_takes_the_long_factors_from_its_first_chunk() -> None:
    scheduler, runner = make_runner(max_num_batched_tokens=8, longrope_switch=16)
    runner.add(req("long", 20, max_tokens=3))
    runner.add(req("short", 6, max_tokens=3))
    seen: dict[str, set[bool]] = {"long": set(), "short": set()}
    while scheduler.has_unfinished_requests():
        out, _ = runner.step()
        for r in out.requests:
            seen[r.req_id].add(r.long_rope)
    assert seen == {"long": {True}, "short": {False}}
    assert scheduler.num_preemptions == 0
    assert_all_free(scheduler)


def test_a_generation_crossing_the_longrope_switch_is_recomputed_whole_with_the_long_factors() -> None:
    """Like transformers' Phi-3: up to 16 tokens the short factors; the decode that would make the
    17th token's KV recomputes all 17 with the long ones instead (a preemption), then decodes on."""
    scheduler, runner = make_runner(longrope_switch=16)
    runner.add(req("a", 14, max_tokens=6))
    steps = [runner.step()[0] for _ in range(4)]
    assert [chunks(out) for out in steps[:3]] == [{"a": (0, 14)}, {"a": (14, 1)}, {"a": (15, 1)}]
    assert not any(r.long_rope for out in steps[:3] for r in out.requests)
    assert steps[3].preempted_req_ids == ["a"] and not steps[3].requests
    out, _ = runner.step()
    [resumed] = out.requests
    assert (resumed.start_pos, len(resumed.token_ids), resumed.is_new, resumed.long_rope) == (0, 17, True, True)
    out, _ = runner.step()
    assert chunks(out) == {"a": (17, 1)} and out.requests[0].long_rope
    runner.drain()
    assert scheduler.num_preemptions == 1
    assert_all_free(scheduler)


def test_the_prefix_cache_keeps_short_and_long_factor_blocks_apart() -> None:
    """Blocks computed with the short factors serve short sequences only, long ones long only."""
    scheduler, runner = make_runner(longrope_switch=16)
    prefix = list(range(500, 512))
    first_short, long_prompt = req("short", prefix, max_tokens=1), req("long", prefix + list(range(8)), max_tokens=1)
    for request in (first_short, long_prompt):  # the long one after the short one's blocks are cached
        runner.add(request)
        runner.drain()
    assert (first_short.num_cached_tokens, long_prompt.num_cached_tokens) == (0, 0)
    again_short, again_long = req("short2", prefix, max_tokens=1), req("long2", prefix + list(range(8)), max_tokens=1)
    runner.add(again_short)
    runner.add(again_long)
    runner.drain()
    assert (again_short.num_cached_tokens, again_long.num_cached_tokens) == (8, 16)
    assert_all_free(scheduler)


def test_async_a_crossing_in_flight_is_recomputed_once_its_token_is_back() -> None:
    scheduler, runner = make_runner(longrope_switch=16)
    runner.add(req("a", 15, max_tokens=6))
    runner.add(req("b", 5, max_tokens=6))
    recomputed = []
    while scheduler.has_unfinished_requests():
        out, _ = runner.step_async()
        recomputed += out.preempted_req_ids
    runner.drain()
    assert recomputed == ["a"]
    assert scheduler.get_request("a") is None
    assert_all_free(scheduler)


# Recovery and wire format.


def test_reset_after_worker_failure_recomputes_everything() -> None:
    scheduler, runner = make_runner()
    runner.add(req("a", 10, max_tokens=5))
    runner.add(req("b", 10, max_tokens=5))
    runner.step()
    runner.step()
    assert scheduler.reset_after_worker_failure().recomputed == ["b", "a"]
    runner.crash()
    assert [r.request_id for r in scheduler.waiting] == ["a", "b"]
    assert scheduler.block_manager.pool.cached == {}
    out, _ = runner.step()
    assert chunks(out) == {"a": (0, 12), "b": (0, 12)}
    assert all(r.is_new for r in out.requests)
    runner.drain()
    assert_all_free(scheduler)


def test_scheduler_output_round_trips_through_msgpack() -> None:
    scheduler, runner = make_runner()
    runner.add(req("a", 10))
    out = scheduler.schedule()
    data = msgspec.msgpack.encode(out)
    assert msgspec.msgpack.decode(data, type=SchedulerOutput) == out
    stats = scheduler.stats()
    assert stats.num_running == 1 and 0 < stats.kv_usage < 1


# Async scheduling: step N+1 scheduled before step N's tokens are back.


def test_async_decode_feeds_a_placeholder_the_runner_fills() -> None:
    scheduler, runner = make_runner()
    runner.add(req("a", 5, max_tokens=3))
    first, updates = runner.step_async(sample=lambda _: 11)
    assert chunks(first) == {"a": (0, 5)} and first.requests[0].sample and updates == []
    # the next step is scheduled before token 11 is back: it feeds a placeholder at position 5
    second, updates = runner.step_async(sample=lambda _: 12)
    (decode,) = second.requests
    assert decode.token_ids == [PLACEHOLDER_TOKEN] and decode.start_pos == 5 and decode.sample
    assert runner.seq["a"][5:] == [11, 12]  # the runner computed position 5 from the token it sampled
    assert [u.new_token_ids for u in updates] == [[11]]  # back after the second step was scheduled
    third, updates = runner.step_async(sample=lambda _: 13)
    assert chunks(third) == {"a": (6, 1)} and third.requests[0].token_ids == [PLACEHOLDER_TOKEN]
    assert [u.new_token_ids for u in updates] == [[12]]
    # max_tokens=3: the token in flight (13) ends the request, so nothing more is scheduled
    fourth, updates = runner.step_async()
    assert fourth.is_empty
    assert [(u.new_token_ids, u.finish_reason) for u in updates] == [([13], "length")]
    assert not scheduler.has_unfinished_requests()
    runner.drain()
    assert_all_free(scheduler)


def test_async_stop_token_in_flight_drops_the_extra_token() -> None:
    scheduler, runner = make_runner()
    runner.add(req("a", 6, max_tokens=10, stop_token_ids=[3]))
    runner.step_async(sample=lambda _: 3)  # the prefill samples the stop token
    extra, updates = runner.step_async(sample=lambda _: 9)  # scheduled before the stop is known
    assert chunks(extra) == {"a": (6, 1)}
    assert [(u.new_token_ids, u.finish_reason) for u in updates] == [([3], "stop")]
    last, updates = runner.step_async()
    assert last.finished_req_ids == ["a"] and updates == []  # the token computed past the stop is dropped
    runner.drain()
    assert_all_free(scheduler)


def test_async_preempted_in_flight_keeps_its_token() -> None:
    # 4 blocks of 4 tokens: "a" (7 tokens) and "b" (8) fill them; b's next decode needs a fifth
    scheduler, runner = make_runner(num_blocks=4, max_model_len=16)
    runner.add(req("a", 7, max_tokens=5))
    runner.add(req("b", 8, max_tokens=5))
    runner.step_async(sample=lambda rid: {"a": 21, "b": 31}[rid])
    second, updates = runner.step_async(sample=lambda rid: 22)
    assert second.preempted_req_ids == ["b"] and chunks(second) == {"a": (7, 1)}
    assert {u.req_id: u.new_token_ids for u in updates} == {"a": [21], "b": [31]}
    b = scheduler.get_request("b")
    assert b.status == RequestStatus.PREEMPTED and b.output_token_ids == [31] and b.num_placeholders == 0
    runner.drain()
    assert_all_free(scheduler)


# Multi-step decode: several decode steps of one step, back to back on the worker.


def test_multi_step_decodes_steady_requests_several_tokens_per_step() -> None:
    scheduler, runner = make_runner(decode_steps=4)
    runner.add(req("a", 5, max_tokens=20))
    runner.add(req("b", 3, max_tokens=20))
    first, _ = runner.step(sample=lambda rid: 11)
    assert first.decode_steps == 1  # prefills run one step
    counter = itertools.count(20)
    second, updates = runner.step(sample=lambda rid: next(counter))
    assert second.decode_steps == 4 and chunks(second) == {"a": (5, 1), "b": (3, 1)}
    assert second.num_scheduled_tokens == 8
    # each request got four tokens, in the order the worker's steps sampled them
    assert {u.req_id: u.new_token_ids for u in updates} == {"a": [20, 22, 24, 26], "b": [21, 23, 25, 27]}
    a = scheduler.get_request("a")
    assert a.num_computed_tokens == a.num_tokens - 1 and a.num_placeholders == 0 and a.decode_steps == 0
    third, _ = runner.step()
    assert chunks(third) == {"a": (9, 1), "b": (7, 1)}  # on from the last token kept
    runner.drain()
    assert_all_free(scheduler)


def test_multi_step_takes_as_many_steps_as_the_request_with_least_room() -> None:
    scheduler, runner = make_runner(decode_steps=8, max_model_len=16)
    runner.add(req("short", 3, max_tokens=4))  # 3 tokens left after its first
    runner.add(req("long", 10, max_tokens=50))  # 5 tokens left before max_model_len after its first
    runner.step()
    out, updates = runner.step()
    assert out.decode_steps == 3
    assert {u.req_id: (len(u.new_token_ids), u.finish_reason) for u in updates} == {
        "short": (3, "length"),
        "long": (3, None),
    }
    out, updates = runner.step()
    assert out.decode_steps == 2 and [(len(u.new_token_ids), u.finish_reason) for u in updates] == [(2, "length")]
    runner.drain()
    assert_all_free(scheduler)


def test_multi_step_waits_while_anything_else_is_to_do() -> None:
    scheduler, runner = make_runner(decode_steps=4, max_num_seqs=1)
    runner.add(req("a", 5, max_tokens=20))
    runner.add(req("b", 5, max_tokens=20))
    runner.step()
    out, _ = runner.step()
    assert out.decode_steps == 1  # "b" waits for a seat: one token at a time until it gets one
    scheduler.abort(["b"])
    runner.forget("b")
    out, _ = runner.step()
    assert out.decode_steps == 4
    runner.add(req("c", 6, max_tokens=3))
    out, _ = runner.step()
    assert out.decode_steps == 1 and chunks(out) == {"a": (10, 1)}
    runner.drain()
    assert_all_free(scheduler)


def test_multi_step_cut_short_gives_back_the_positions_it_did_not_compute() -> None:
    scheduler, runner = make_runner(decode_steps=4)
    runner.cut = lambda steps: 2  # the worker stops after two steps (a request arrived)
    runner.add(req("a", 6, max_tokens=20))
    runner.step()
    out, updates = runner.step(sample=lambda _: 5)
    assert out.decode_steps == 4 and [u.new_token_ids for u in updates] == [[5, 5]]
    a = scheduler.get_request("a")
    assert a.num_computed_tokens == 8 == a.num_tokens - 1
    runner.cut = None
    out, _ = runner.step()
    assert chunks(out) == {"a": (8, 1)}  # FakeRunner checks that every position read holds its KV
    runner.drain()
    assert_all_free(scheduler)


def test_multi_step_stop_token_ends_the_request_and_drops_what_followed() -> None:
    scheduler, runner = make_runner(decode_steps=4)
    runner.add(req("a", 6, max_tokens=20, stop_token_ids=[3]))
    runner.step(sample=lambda _: 9)
    tokens = iter([9, 3, 9, 9])
    out, updates = runner.step(sample=lambda _: next(tokens))
    assert out.decode_steps == 4
    assert [(u.new_token_ids, u.finish_reason) for u in updates] == [([9, 3], "stop")]
    assert_all_free(scheduler)


def test_multi_step_tokens_fed_ahead_of_the_result_count_once() -> None:
    """A stream's tokens come decode step by decode step while the multi-step decode runs
    (``partial``): each counts once, the slots of the steps still running stay counted until the
    result brings the rest, and one that ends its request frees its blocks there and then."""
    scheduler, runner = make_runner(decode_steps=4)
    runner.add(req("a", 6, max_tokens=20))
    runner.add(req("b", 6, max_tokens=20, stop_token_ids=[3]))
    runner.step(sample=lambda _: 9)
    out = scheduler.schedule()
    assert out.decode_steps == 4
    runner.cut = lambda steps: 3  # a request arrived during the third decode step
    tokens = {"a": iter([5, 5, 7]), "b": iter([6, 3, 9])}
    assert runner.execute(out, sample=lambda rid: next(tokens[rid])) == {"a": [5, 5, 7], "b": [6, 3, 9]}
    a, b = scheduler.get_request("a"), scheduler.get_request("b")
    used = scheduler.block_manager.num_free_blocks
    first = scheduler.update_from_output({"a": [5], "b": [6]}, partial=True)
    assert [(u.req_id, u.new_token_ids, u.finish_reason) for u in first] == [("a", [5], None), ("b", [6], None)]
    assert a.decode_steps == 3 and a.num_placeholders == 3 and a.num_computed_tokens == 10
    second = scheduler.update_from_output({"a": [5], "b": [3]}, partial=True)
    assert [(u.req_id, u.new_token_ids, u.finish_reason) for u in second] == [("a", [5], None), ("b", [3], "stop")]
    assert b.is_finished and scheduler.block_manager.num_free_blocks > used
    runner.forget("b")
    last = scheduler.update_from_output({"a": [7], "b": [9]})  # the result: the rest ("b"'s is dropped)
    assert [(u.req_id, u.new_token_ids) for u in last] == [("a", [7])]
    assert a.output_token_ids == [9, 5, 5, 7] and a.decode_steps == 0 and a.num_placeholders == 0
    assert a.num_computed_tokens == a.num_tokens - 1  # the fourth decode step's position is recomputed
    scheduler.check_invariants()
    runner.tokens["a"] += [5, 5, 7]
    runner.cut = None
    out, _ = runner.step()
    assert chunks(out) == {"a": (9, 1)}  # FakeRunner checks that every position read holds its KV
    runner.drain()
    assert_all_free(scheduler)


def test_multi_step_without_room_in_the_cache_runs_one_step_and_preempts_nobody() -> None:
    # 4 blocks of 4: "a" (7 tokens) and "b" (7) hold two each; four more tokens need a fifth block
    scheduler, runner = make_runner(num_blocks=4, max_model_len=16, decode_steps=4)
    runner.add(req("a", 7, max_tokens=8))
    runner.add(req("b", 7, max_tokens=8))
    runner.step()
    out, _ = runner.step()
    assert out.decode_steps == 1 and not out.preempted_req_ids and chunks(out) == {"a": (7, 1), "b": (7, 1)}
    runner.drain()
    assert_all_free(scheduler)


def test_multi_step_refuses_what_it_cannot_run_with() -> None:
    from sonar.core.speculative import SpeculativeConfig

    with pytest.raises(ValueError, match="decode_steps must be a positive integer"):
        SchedulerConfig(max_model_len=64, decode_steps=0)
    with pytest.raises(ValueError, match="decode_steps above 1 runs without speculative decoding"):
        SchedulerConfig(max_model_len=64, decode_steps=2, speculative=SpeculativeConfig("ngram", 2))
    with pytest.raises(ValueError, match="on one pipeline stage"):
        SchedulerConfig(max_model_len=64, decode_steps=2, pipeline_stages=2)


def test_multi_step_worker_crash_forgets_the_steps_in_flight() -> None:
    scheduler, runner = make_runner(decode_steps=4)
    runner.add(req("a", 6, max_tokens=20))
    runner.step()
    scheduler.schedule()  # a multi-step decode goes out, and the worker dies in it
    assert scheduler.get_request("a").decode_steps == 4
    scheduler.reset_after_worker_failure()
    runner.crash()
    a = scheduler.get_request("a")
    assert a.decode_steps == 0 and a.num_placeholders == 0 and a.status == RequestStatus.PREEMPTED
    scheduler.check_invariants()
    runner.drain()
    assert_all_free(scheduler)


# Cost per step as the number of running requests grows.


def traced_lines(fn: Any) -> int:
    """Python lines run by ``fn()`` and its callees: a measure of work that, unlike a clock, a
    busy machine does not change (loops and comprehensions count a line per iteration)."""
    count = 0

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "line":
            count += 1
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(previous)
    return count


def decoding(n: int) -> Scheduler:
    """A scheduler with ``n`` requests past their prefill, each decoding."""
    scheduler, _ = make_runner(num_blocks=n * 8, max_model_len=32, max_num_batched_tokens=16 * n, max_num_seqs=n)
    for i in range(n):
        scheduler.add_request(req(f"r{i}", 8, max_tokens=20))
    out = scheduler.schedule()
    scheduler.update_from_output({r.req_id: [1] for r in out.requests})
    assert scheduler.num_running == n
    return scheduler


def decode_step(scheduler: Scheduler) -> None:
    out = scheduler.schedule()
    assert len(out.requests) == scheduler.num_running
    scheduler.update_from_output({r.req_id: [2] for r in out.requests})


@pytest.mark.parametrize(
    "work",
    [
        pytest.param(decode_step, id="decode_step"),
        pytest.param(lambda s: s.finish_stopped({f"r{i}": "\n" for i in range(0, s.num_running, 2)}), id="stop_half"),
        pytest.param(lambda s: s.abort([f"r{i}" for i in range(1, s.num_running, 2)]), id="abort_half"),
        pytest.param(
            lambda s: s.fail_requests(
                {f"r{i}": RequestError("sampling", "no token") for i in range(0, s.num_running, 3)}
            ),
            id="fail_third",
        ),
    ],
)
def test_work_per_step_grows_linearly_with_running_requests(work: Any) -> None:
    """Four times the running requests cost about four times the work, not sixteen: nothing in a
    step (or in finishing many requests at once) scans every request for each request."""
    small, large = (traced_lines(lambda s=decoding(n): work(s)) for n in (64, 256))
    assert large < 5 * small, (small, large)


# Pipeline stages: several steps in flight at once, of different requests.


def test_pipeline_stages_make_micro_batches_of_different_requests() -> None:
    scheduler, _ = make_runner(pipeline_stages=2)
    for rid in "abcd":
        scheduler.add_request(req(rid, 5, max_tokens=3))
    first = scheduler.schedule()
    assert chunks(first) == {"a": (0, 5), "b": (0, 5)}  # its share: half of the four
    second = scheduler.schedule()  # the first is still in flight
    assert chunks(second) == {"c": (0, 5), "d": (0, 5)}
    assert scheduler.schedule().is_empty  # every request has a token in flight
    scheduler.update_from_output({"a": [1], "b": [2]})
    third = scheduler.schedule()
    assert chunks(third) == {"a": (5, 1), "b": (5, 1)}
    assert [r.token_ids for r in third.requests] == [[1], [2]]  # known tokens, never a placeholder
    scheduler.update_from_output({"c": [3], "d": [4]})
    fourth = scheduler.schedule()
    assert chunks(fourth) == {"c": (5, 1), "d": (5, 1)}
    scheduler.check_invariants()


def test_pipeline_stages_let_a_prefill_continue_in_the_next_step() -> None:
    """A chunk that samples nothing leaves no token in flight: every stage runs steps in order,
    so the next chunk can follow at once."""
    scheduler, _ = make_runner(pipeline_stages=2, max_num_batched_tokens=8)
    scheduler.add_request(req("a", 20, max_tokens=2))
    assert chunks(scheduler.schedule()) == {"a": (0, 8)}
    assert chunks(scheduler.schedule()) == {"a": (8, 8)}
    last = scheduler.schedule()
    assert chunks(last) == {"a": (16, 4)} and last.requests[0].sample
    assert scheduler.schedule().is_empty  # its first token is in flight


# LoRA adapters.


def _adapter(name: str) -> LoRARequest:
    return LoRARequest(name, f"/adapters/{name}", digest=name * 8)


def test_adapters_do_not_share_cached_blocks() -> None:
    scheduler, runner = make_runner()
    runner.add(req("a", range(12), max_tokens=1, lora=_adapter("x")))
    runner.drain()
    runner.add(req("base", range(12), max_tokens=1))
    runner.add(req("other", range(12), max_tokens=1, lora=_adapter("y")))
    runner.add(req("same", range(12), max_tokens=1, lora=_adapter("x")))
    out, _ = runner.step()
    assert chunks(out) == {"base": (0, 12), "other": (0, 12), "same": (8, 4)}
    runner.drain()
    assert_all_free(scheduler)


def test_at_most_max_loras_adapters_run_and_the_others_wait_their_turn() -> None:
    scheduler, runner = make_runner(max_loras=2)
    adapter_of = {"x1": "x", "y1": "y", "z1": "z", "x2": "x", "base": None}
    for rid, name in adapter_of.items():  # z1, a third adapter, has no slot yet; x2 behind it has
        runner.add(req(rid, 4, max_tokens=3, lora=None if name is None else _adapter(name)))
    out, _ = runner.step()
    assert sorted(chunks(out)) == ["base", "x1", "x2", "y1"]
    assert [r.request_id for r in scheduler.waiting] == ["z1"]
    stats = scheduler.stats()
    assert (stats.running_loras, stats.waiting_loras) == (["x", "y"], ["z"])
    seen = set()
    while scheduler.running or len(scheduler.waiting):
        out, _ = runner.step()
        adapters = {adapter_of[r.req_id] for r in out.requests} - {None}
        assert len(adapters) <= 2
        seen |= {r.req_id for r in out.requests}
    assert "z1" in seen
    assert_all_free(scheduler)


# Pooling requests: they end with their prompt.


def test_a_pooling_request_ends_with_its_last_prompt_chunk() -> None:
    scheduler, _ = make_runner(max_num_batched_tokens=8, long_prefill_token_threshold=8)
    scheduler.add_request(req("p", 20, max_tokens=1, pooling_params="embed"))
    steps = []
    while True:
        out = scheduler.schedule()
        if not out.requests:
            break
        (sched,) = out.requests
        steps.append((sched.start_pos, len(sched.token_ids), sched.sample))
        if sched.sample:
            (update,) = scheduler.finish_pooled(["p"])
            assert (update.finish_reason, update.new_token_ids) == ("stop", [])
    assert steps == [(0, 8, False), (8, 8, False), (16, 4, True)]
    assert scheduler.finish_pooled(["p"]) == []  # a late or repeated result is ignored
    assert_all_free(scheduler)


def test_a_pooling_request_is_not_scheduled_again_while_its_step_is_in_flight() -> None:
    """Async scheduling schedules the next step before the last one's result is back: the
    pooling request (max_tokens 1) sits that step out, and its result then finishes it."""
    scheduler, _ = make_runner()
    scheduler.add_request(req("p", 6, max_tokens=1))
    first = scheduler.schedule()
    assert chunks(first) == {"p": (0, 6)} and first.requests[0].sample
    assert scheduler.schedule().requests == []
    (update,) = scheduler.finish_pooled(["p"])
    assert update.finish_reason == "stop"
    assert_all_free(scheduler)


def test_a_pooling_request_preempted_while_its_step_was_in_flight_is_done() -> None:
    scheduler, _ = make_runner()
    scheduler.add_request(req("p", 6, max_tokens=1))
    scheduler.schedule()
    request = scheduler.running.pop()
    scheduler._preempt(request)
    (update,) = scheduler.finish_pooled(["p"])
    assert update.finish_reason == "stop"
    assert_all_free(scheduler)


# Per-request timing (--enable-per-request-metrics).


def test_the_first_token_update_carries_queue_time_and_time_to_first_token() -> None:
    now = [10.0]
    bm = BlockManager(64, BS, enable_prefix_caching=True)
    scheduler = Scheduler(
        SchedulerConfig(max_model_len=64, max_num_batched_tokens=8, max_num_seqs=8), bm, clock=lambda: now[0]
    )
    runner = FakeRunner(scheduler)
    runner.add(req("a", 12, arrival_time=9.5))  # two prefill chunks of 8 and 4
    now[0] = 10.25
    out, updates = runner.step()
    assert chunks(out) == {"a": (0, 8)} and [u.new_token_ids for u in updates] == []
    now[0] = 11.0
    _, updates = runner.step()
    assert [u.new_token_ids for u in updates] == [[7]]
    timing = updates[0].timing
    assert timing is not None
    assert (timing.queue_seconds, timing.first_token_seconds) == pytest.approx((0.75, 0.75))
    _, updates = runner.step()
    assert updates[0].new_token_ids == [7] and updates[0].timing is None


# Media kept whole (Gemma 3: an image's tokens attend to each other).


def test_a_chunk_never_ends_inside_an_image_with_whole_media() -> None:
    """Chunks end before an image, or after it where they start at it (past the long-prefill
    threshold); without whole_media the same prompt is cut through the images."""
    media = [(5, 6, "a"), (13, 6, "b")]
    scheduler, runner = make_runner(max_num_batched_tokens=8, long_prefill_token_threshold=4, whole_media=True)
    runner.add(req("a", 24, media=media, max_tokens=1))
    ends = []
    for _ in range(6):
        out, _ = runner.step()
        ends += [start + n for start, n in chunks(out).values()]
    # 0-4 (the threshold), 4-5 (before image a), 5-11 (image a whole, past the threshold), 11-13, 13-19, 19-23, 23-24
    assert ends[:6] == [4, 5, 11, 13, 19, 23]
    runner.drain()
    assert_all_free(scheduler)
    scheduler, runner = make_runner(max_num_batched_tokens=8, long_prefill_token_threshold=4)
    runner.add(req("a", 24, media=media, max_tokens=1))
    out, _ = runner.step()
    out, _ = runner.step()
    assert chunks(out) == {"a": (4, 4)}  # 4-8: inside image a
    runner.drain()


def test_an_image_that_does_not_fit_the_budget_left_waits() -> None:
    """Decodes take part of the budget: the image's chunk waits for a step with room, whole."""
    scheduler, runner = make_runner(max_num_batched_tokens=8, whole_media=True)
    runner.add(req("dec", 3, max_tokens=4))
    runner.step()
    runner.add(req("img", 10, media=[(1, 8, "x")], max_tokens=1))
    out, _ = runner.step()
    assert chunks(out) == {"dec": (3, 1), "img": (0, 1)}  # the budget left (7) ends before the image
    out, _ = runner.step()
    assert chunks(out) == {"dec": (4, 1)}  # the image (8 tokens) needs a whole step's budget
    runner.drain()
    assert_all_free(scheduler)


def test_images_that_touch_are_kept_whole_together() -> None:
    """Two images with no token between are one run of image tokens (one block of the mask)."""
    scheduler, runner = make_runner(max_num_batched_tokens=16, whole_media=True)
    runner.add(req("a", 20, media=[(2, 6, "a"), (8, 6, "b")], max_tokens=1))
    out, _ = runner.step()
    assert chunks(out) == {"a": (0, 16)}  # past the run: no cut
    runner.drain()
    scheduler, runner = make_runner(max_num_batched_tokens=12, whole_media=True)
    runner.add(req("a", 20, media=[(2, 6, "a"), (8, 6, "b")], max_tokens=1))
    out, _ = runner.step()
    assert chunks(out) == {"a": (0, 2)}  # 0-12 ends inside the run 2-14: before it
    out, _ = runner.step()
    assert chunks(out) == {"a": (2, 12)}
    runner.drain()
    assert_all_free(scheduler)
