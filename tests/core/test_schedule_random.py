"""Seeded random workloads: arrivals, siblings, aborts, stops, worker crashes, tiny caches.

Every step goes through ``FakeRunner``, which checks the budget and batch limits and that
every KV position a request attends to holds what its own tokens imply; the scheduler's
invariants are checked before and after each step. At the end everything drains and the
cache must be entirely free.
"""

import random
from typing import Any

import pytest

from sonar.core.blocks import BlockManager
from sonar.core.request import Request
from sonar.core.schedule import Scheduler, SchedulerConfig
from sonar.core.speculative import SpeculativeConfig
from tests.core.simulate import FakeRunner

CONFIGS: dict[str, dict[str, Any]] = {
    "fcfs-chunked": {"scheduling_policy": "fcfs"},
    "priority-chunked": {"scheduling_policy": "priority"},
    "fcfs-no-chunking": {"enable_chunked_prefill": False, "max_num_batched_tokens": 48},
    "priority-no-chunking": {
        "scheduling_policy": "priority",
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": 48,
    },
    "threshold-watermark": {"long_prefill_token_threshold": 6, "watermark": 0.1},
    "no-reserve": {"scheduler_reserve_full_isl": False, "max_num_seqs": 6},
    "no-prefix-caching": {"prefix_caching": False},
    "xxhash-cbor": {"hash_algo": "xxhash_cbor"},
    # async scheduling with n-gram drafts made by the worker, guessing right about half the time
    "worker-drafts": {
        "speculative": SpeculativeConfig("ngram", 3, prompt_lookup_min=2, prompt_lookup_max=2),
        "worker_drafts": True,
        "alphabet": 2,
    },
    # the same with a draft model's (or head's) lookahead: KV slots past each sampling step
    "worker-drafts-lookahead": {
        "speculative": SpeculativeConfig("draft_model", 3, model="draft"),
        "worker_drafts": True,
        "alphabet": 2,
    },
    # multi-step decode, the worker cutting some steps short (the synchronous loop only)
    "multi-step": {"decode_steps": 4},
    # and its tokens fed back decode step by decode step while it runs (a stream's `StepTokens`)
    "multi-step-streamed": {"decode_steps": 4, "streamed": True},
}

SYNC_ONLY = {"multi-step", "multi-step-streamed"}
"""Configurations the async loop never runs with (the shell keeps them synchronous)."""

STOP_TOKEN = 3


def run_workload(seed: int, steps: int, options: dict[str, Any], pipelined: bool = False) -> FakeRunner:
    rng = random.Random(seed)
    options = dict(options)
    block_size = rng.choice([2, 4, 8])
    prefix_caching = options.pop("prefix_caching", True)
    hash_algo = options.pop("hash_algo", "sha256")
    alphabet = options.pop("alphabet", 60)
    streamed = options.pop("streamed", False)
    config = SchedulerConfig(**{"max_model_len": 48, "max_num_batched_tokens": 16, "max_num_seqs": 4, **options})
    num_blocks = -(-config.max_model_len // block_size) + rng.randint(0, 8)
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching, hash_algo=hash_algo)
    scheduler = Scheduler(config, bm)

    def propose(seq: list[int], n: int) -> list[int]:  # the worker's proposer: 0 to n guesses
        return [rng.randrange(0, alphabet) for _ in range(rng.randint(0, n))]

    def cut(steps: int) -> int:  # the worker stops a multi-step decode early, now and then
        return rng.randint(1, steps) if rng.random() < 0.3 else steps

    def ahead(ran: int) -> int:  # how many of them came as sampled; a late one brings the rest with the result
        return ran - 1 if rng.random() < 0.8 else rng.randint(0, ran - 1)

    runner = FakeRunner(scheduler, propose, cut, ahead if streamed else None)
    prefixes = [[rng.randrange(4, 60) for _ in range(rng.randint(1, 30))] for _ in range(4)]
    ids = iter(range(10**6))

    def new_prompt() -> list[int]:
        prompt = list(rng.choice(prefixes)) if rng.random() < 0.7 else []
        prompt += [rng.randrange(4, 60) for _ in range(rng.randint(1, 20))]
        return prompt[: rng.randint(1, config.max_model_len)]

    def add(prompt: list[int], **kwargs: Any) -> None:
        runner.add(
            Request(
                f"r{next(ids)}",
                prompt,
                max_tokens=rng.choice([1, 2, 5, 10, 30, None]),
                min_tokens=rng.choice([0, 0, 2]),
                stop_token_ids=[STOP_TOKEN] if rng.random() < 0.5 else [],
                priority=rng.randint(0, 3),
                cache_salt=rng.choice([None, None, "tenant"]),
                **kwargs,
            )
        )

    for _ in range(steps):
        if rng.random() < 0.35:
            if rng.random() < 0.2:
                prompt = new_prompt()
                for _ in range(rng.randint(2, 3)):
                    add(prompt)
            else:
                add(new_prompt())
        if scheduler.requests and rng.random() < 0.05:
            victim = rng.choice(list(scheduler.requests))
            assert scheduler.abort([victim]) == [victim]
            runner.forget(victim)
        if rng.random() < 0.01:
            scheduler.reset_after_worker_failure()
            runner.crash()
            scheduler.check_invariants()
        stopped = None
        if scheduler.running and rng.random() < 0.03:
            stopped = {rng.choice(scheduler.running).request_id: "stop-string"}
        step = runner.step_async if pipelined else runner.step
        step(sample=lambda _: rng.randrange(0, alphabet), stopped=stopped)

    runner.drain()
    scheduler.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    assert not scheduler.running and not len(scheduler.waiting)
    return runner


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    ("name", "pipelined"),
    [(name, pipelined) for name in CONFIGS for pipelined in (False, True) if not (pipelined and name in SYNC_ONLY)],
    ids=lambda value: {False: "sync", True: "async"}.get(value, value),
)
def test_random_workload(name: str, seed: int, pipelined: bool) -> None:
    """``async``: each step is scheduled and run before the previous one's tokens come back."""
    if CONFIGS[name].get("hash_algo", "").startswith("xxhash"):
        pytest.importorskip("xxhash")
        pytest.importorskip("cbor2")
    runner = run_workload(seed * 7919 + list(CONFIGS).index(name), 500, CONFIGS[name], pipelined)
    stats = runner.scheduler.stats()
    assert stats.kv_usage == 0.0
    if CONFIGS[name].get("prefix_caching", True):
        assert stats.prefix_hits > 0
    if CONFIGS[name].get("worker_drafts"):
        assert stats.spec_num_accepted_tokens > 0
    if CONFIGS[name].get("decode_steps", 1) > 1:
        assert runner.multi_steps > 0
    if CONFIGS[name].get("streamed"):
        assert runner.streamed_steps > 0
