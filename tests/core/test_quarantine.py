"""Quarantine: a request that crashes the worker is found by running suspects one at a time and is
failed alone; crashes that follow no request leave everyone in (the supervisor gives up instead).

The scheduler runs against the fake runner of `tests.core.simulate`; the "worker" crashes on every
step whose input holds a poison token, as `--fault-injection raise@token=ID` makes the real one do.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from sonar.core.outputs import RequestError, RequestUpdate, SchedulerOutput
from sonar.core.quarantine import Quarantine
from sonar.core.request import RequestStatus
from tests.core.test_schedule import assert_all_free, make_runner, req

POISON = 666


# The bookkeeping alone.


def test_suspects_are_cleared_by_sampling_and_convicted_alone_after_a_witness() -> None:
    q = Quarantine()
    assert q.crashed(["p", "a", "b"], live=["p", "a", "b"]) == {}
    assert set(q.suspects) == {"p", "a", "b"} and q.ready("x") and q.ready("p")
    q.passed(sampled=["a"], bystanders=["p", "b"])  # a sampled alone: cleared; p and b saw a witness
    assert "a" not in q and "p" in q
    assert q.crashed(["p", "a"], live=["p", "a", "b"]) == {"p": 2}  # p alone among suspects, witnessed
    assert "p" not in q and "a" in q  # the request beside it is a suspect again
    q.discard("a")
    q.discard("b")
    assert not q


def test_a_suspect_that_fails_alone_without_a_witness_waits_for_one() -> None:
    q = Quarantine()
    q.crashed(["p", "a"], live=["p", "a"])
    assert q.crashed(["p"], live=["p", "a"]) == {}  # nothing has shown a step without p passes
    assert not q.ready("p") and q.ready("a")
    q.passed(sampled=["a"], bystanders=["p"])
    assert q.ready("p")
    assert q.crashed(["p"], live=["p", "a"]) == {"p": 3}


def test_the_last_request_left_is_convicted_at_its_second_crash() -> None:
    q = Quarantine()
    assert q.crashed(["p"], live=["p"]) == {}
    assert q.crashed(["p"], live=["p"]) == {"p": 2}


# The scheduler core with a worker that crashes.


@dataclass
class Outcome:
    crashes: int = 0
    finished: dict[str, RequestUpdate] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    steps: list[SchedulerOutput] = field(default_factory=list)


def run(
    scheduler,
    runner,
    crashes_on=lambda out: any(POISON in r.token_ids for r in out.requests),
    max_crashes: int = 1000,
    max_steps: int = 5000,
) -> Outcome:
    """Step until every request has finished or `max_crashes` steps have failed; a failed step's
    requests are handed to `reset_after_worker_failure`, as the scheduler actor does."""
    outcome = Outcome()
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests() or outcome.crashes >= max_crashes:
            return outcome
        out = scheduler.schedule()
        scheduler.check_invariants()
        runner.check_output(out)
        outcome.steps.append(out)
        suspects = [r.req_id for r in out.requests if r.req_id in scheduler.quarantine]
        assert len(suspects) <= 1, f"suspects {suspects} share a step"
        if crashes_on(out):
            outcome.crashes += 1
            recovery = scheduler.reset_after_worker_failure([r.req_id for r in out.requests])
            runner.crash()
            scheduler.check_invariants()
            updates = recovery.quarantined
        else:
            runner.in_flight = runner.execute(out)
            updates = runner._feed_back(runner.in_flight, None)
        for update in updates:
            outcome.tokens.setdefault(update.req_id, []).extend(update.new_token_ids)
            if update.finish_reason is not None:
                outcome.finished[update.req_id] = update
                runner.forget(update.req_id)
    raise AssertionError(f"still unfinished after {max_steps} steps")


def run_async(
    scheduler,
    runner,
    crashes_on=lambda out: any(POISON in r.token_ids for r in out.requests),
    max_crashes: int = 1000,
    max_steps: int = 5000,
) -> Outcome:
    """`run` with async scheduling, as the scheduler actor pipelines steps: step N+1 is scheduled
    and run before step N's tokens are fed back; when step N failed, step N+1 is void and the
    requests of step N go to `reset_after_worker_failure`."""
    outcome = Outcome()
    previous: tuple[SchedulerOutput, dict[str, list[int]] | None] | None = None
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests() and previous is None or outcome.crashes >= max_crashes:
            return outcome
        out = scheduler.schedule()
        scheduler.check_invariants()
        updates: list[RequestUpdate] = []
        if previous is not None and previous[1] is None:  # step N failed: N+1 is void
            outcome.crashes += 1
            recovery = scheduler.reset_after_worker_failure([r.req_id for r in previous[0].requests])
            runner.crash()
            scheduler.check_invariants()
            updates, previous = recovery.quarantined, None
        else:
            runner.check_output(out)
            outcome.steps.append(out)
            suspects = [r.req_id for r in out.requests if r.req_id in scheduler.quarantine]
            assert len(suspects) <= 1, f"suspects {suspects} share a step"
            result = None if crashes_on(out) else runner.execute(out)
            if previous is not None:
                updates = runner._feed_back(previous[1], None)
            previous = (out, result) if out.requests or result is None else None
        for update in updates:
            outcome.tokens.setdefault(update.req_id, []).extend(update.new_token_ids)
            if update.finish_reason is not None:
                outcome.finished[update.req_id] = update
                runner.forget(update.req_id)
    raise AssertionError(f"still unfinished after {max_steps} steps")


@pytest.mark.parametrize("position", [0, 1, 3])
def test_a_poison_request_is_quarantined_and_the_others_complete(position: int) -> None:
    scheduler, runner = make_runner(num_blocks=128, max_num_batched_tokens=64)
    ids = [f"r{i}" for i in range(4)]
    for i, rid in enumerate(ids):
        prompt = [1000 * (i + 1) + t for t in range(9)]
        if i == position:
            prompt[5] = POISON
        runner.add(req(rid, prompt, max_tokens=6))
    outcome = run(scheduler, runner)
    poisoned = ids[position]
    failed = outcome.finished[poisoned]
    assert failed.finish_reason == "error" and failed.error is not None
    assert failed.error.type == "quarantined" and poisoned in failed.error.message
    assert 2 <= outcome.crashes <= 3
    for rid in ids:
        if rid != poisoned:
            update = outcome.finished[rid]
            assert update.finish_reason == "length" and update.error is None
            assert outcome.tokens[rid] == [7] * 6
    assert not scheduler.quarantine
    assert_all_free(scheduler)


def test_suspects_of_a_crash_that_does_not_recur_rerun_one_at_a_time_and_all_finish() -> None:
    """A crash that follows no request (a SIGKILL, say): its requests are suspects, each is
    admitted alone (beside the cleared ones) until it samples, then everything runs together."""
    scheduler, runner = make_runner(num_blocks=128)
    for i in range(4):
        runner.add(req(f"r{i}", 6, max_tokens=5))
    crashed = []

    def once(out):
        if not crashed and scheduler.stats().num_running == 4:
            crashed.append(out)
            return True
        return False

    outcome = run(scheduler, runner, crashes_on=once)
    assert outcome.crashes == 1 and all(u.finish_reason == "length" for u in outcome.finished.values())
    after = [out for out in outcome.steps if out.step_id > crashed[0].step_id]
    admitted = [[r.req_id for r in out.requests if r.is_new] for out in after]
    assert [a for a in admitted if a][:4] == [["r0"], ["r1"], ["r2"], ["r3"]]
    assert_all_free(scheduler)


@pytest.mark.parametrize("num_requests", [2, 5])
def test_a_worker_that_crashes_on_every_step_convicts_nobody(num_requests: int) -> None:
    """Every step fails whatever it holds: no witness ever comes, so nobody is quarantined and the
    crashes go on (the engine's supervisor gives up on its restart intensity)."""
    scheduler, runner = make_runner()
    for i in range(num_requests):
        runner.add(req(f"r{i}", 6))
    outcome = run(scheduler, runner, crashes_on=lambda out: bool(out.requests), max_crashes=12)
    assert outcome.crashes == 12 and outcome.finished == {}
    assert len(scheduler.requests) == num_requests


def test_a_lone_request_that_crashes_twice_is_quarantined() -> None:
    scheduler, runner = make_runner()
    runner.add(req("only", 6))
    outcome = run(scheduler, runner, crashes_on=lambda out: bool(out.requests))
    assert outcome.crashes == 2 and outcome.finished["only"].error.type == "quarantined"
    assert_all_free(scheduler)


def test_fail_requests_ends_one_request_with_its_error_wherever_it_is() -> None:
    scheduler, runner = make_runner(max_num_seqs=1)
    runner.add(req("run", 6, max_tokens=8))
    runner.add(req("wait", 6))
    runner.step()
    error = RequestError("sampling", "no token left")
    updates = scheduler.fail_requests({"run": error, "wait": error, "gone": error})
    assert [(u.req_id, u.finish_reason, u.error) for u in updates] == [
        ("run", "error", error),
        ("wait", "error", error),
    ]
    assert RequestStatus.FINISHED_ERROR.is_finished
    assert_all_free(scheduler)


def test_a_poison_prompt_arriving_beside_running_requests_costs_two_crashes() -> None:
    """The requests that had sampled before the crash run alone first; their passing steps witness
    for the new one, which is convicted at its first run alone."""
    scheduler, runner = make_runner(num_blocks=128)
    for i in range(3):
        runner.add(req(f"r{i}", 6, max_tokens=12))
    runner.step()
    runner.step()
    runner.add(req("poison", [1, 2, POISON, 4]))
    outcome = run(scheduler, runner)
    assert outcome.crashes == 2 and outcome.finished["poison"].error.type == "quarantined"
    assert all(outcome.finished[f"r{i}"].finish_reason == "length" for i in range(3))
    assert_all_free(scheduler)


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("seed", range(40))
def test_random_poison_requests_are_quarantined_and_only_they(seed: int, pipelined: bool) -> None:
    """Innocent requests always finish, and only poisoned ones are quarantined. Several poisons
    that are all that is left look like a worker that fails every step: nobody is convicted and
    the crashes go on (the engine's restart intensity ends them), so the run is cut at 40."""
    rng = random.Random(seed)
    scheduler, runner = make_runner(
        num_blocks=96,
        max_num_batched_tokens=rng.choice([16, 32, 64]),
        max_num_seqs=rng.choice([3, 8]),
        scheduling_policy=rng.choice(["fcfs", "priority"]),
    )
    poisoned = set()
    ids = [f"r{i}" for i in range(rng.randint(2, 7))]
    for i in range(len(ids)):
        prompt = [1000 * (i + 1) + t for t in range(rng.randint(3, 20))]
        if rng.random() < 0.3:
            prompt[rng.randrange(len(prompt))] = POISON
            poisoned.add(f"r{i}")
        runner.add(req(f"r{i}", prompt, max_tokens=rng.randint(1, 6), priority=rng.randint(0, 2)))
    outcome = (run_async if pipelined else run)(scheduler, runner, max_crashes=40)
    assert {rid for rid, u in outcome.finished.items() if u.finish_reason == "error"} <= poisoned
    innocent = set(ids) - poisoned
    assert {
        rid for rid in innocent if rid in outcome.finished and outcome.finished[rid].finish_reason == "length"
    } == innocent
    left = set(scheduler.requests)
    assert left <= poisoned
    if left:  # a stall among poisons alone (one left alone is convicted)
        assert outcome.crashes == 40 and len(left) >= 2
    else:
        assert outcome.crashes <= 3 * len(poisoned)
        assert_all_free(scheduler)
