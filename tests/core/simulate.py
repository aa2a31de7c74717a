"""A fake model runner for scheduler tests: a KV cache of fingerprints, checked on every read.

The "KV" written at position ``p`` of a request is a fingerprint of the request's salt and
tokens ``0..p``, computed the way attention would: from the fingerprint already in the cache
at ``p - 1`` and token ``p``. Before each step's reads, the runner checks every position a
request attends to against the fingerprints its own tokens imply, so a wrongly shared,
evicted, overwritten or never-computed block fails the test at once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from sonar.core.outputs import RequestUpdate, SchedulerOutput
from sonar.core.request import Request
from sonar.core.schedule import Scheduler

Fingerprint = int


def fingerprint(prev: Fingerprint | None, token: int, salt: str | None) -> Fingerprint:
    return hash((prev, token)) if prev is not None else hash((salt, token))


class FakeRunner:
    """Simulates the worker's KV cache and checks each step the scheduler produces."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.block_size = scheduler.block_manager.block_size
        self.kv: dict[tuple[int, int], Fingerprint] = {}
        self.tokens: dict[str, list[int]] = {}
        self.salts: dict[str, str | None] = {}
        self.expected: dict[str, list[Fingerprint]] = {}

    def add(self, request: Request) -> None:
        """Add ``request`` to the scheduler and remember its tokens independently."""
        self.scheduler.add_request(request)
        self.tokens[request.request_id] = list(request.prompt_token_ids)
        self.salts[request.request_id] = request.cache_salt
        self.expected[request.request_id] = []

    def _expected(self, request_id: str, upto: int) -> list[Fingerprint]:
        chain = self.expected[request_id]
        tokens = self.tokens[request_id]
        salt = self.salts[request_id]
        while len(chain) < upto:
            prev = chain[-1] if chain else None
            chain.append(fingerprint(prev, tokens[len(chain)], salt))
        return chain

    def _slot(self, block_ids: Sequence[int], pos: int) -> tuple[int, int]:
        return block_ids[pos // self.block_size], pos % self.block_size

    def check_output(self, out: SchedulerOutput) -> None:
        config = self.scheduler.config
        total = sum(len(r.token_ids) for r in out.requests)
        assert total == out.num_scheduled_tokens <= config.max_num_batched_tokens
        assert len(out.requests) <= config.max_num_seqs
        assert len({r.req_id for r in out.requests}) == len(out.requests)
        for r in out.requests:
            tokens = self.tokens[r.req_id]
            end = r.start_pos + len(r.token_ids)
            assert r.token_ids, r
            assert r.token_ids == tokens[r.start_pos : end], r
            assert r.sample == (end == len(tokens)), r
            assert len(r.block_ids) * self.block_size >= end, r
            assert r.num_prompt_tokens <= len(tokens)

    def execute(self, out: SchedulerOutput) -> None:
        """Write the step's KV in batch order, then check every read of the step."""
        for r in out.requests:
            salt = self.salts[r.req_id]
            for i, token in enumerate(r.token_ids):
                pos = r.start_pos + i
                prev = self.kv[self._slot(r.block_ids, pos - 1)] if pos else None
                self.kv[self._slot(r.block_ids, pos)] = fingerprint(prev, token, salt)
        for r in out.requests:
            end = r.start_pos + len(r.token_ids)
            chain = self._expected(r.req_id, end)
            for pos in range(end):
                got = self.kv.get(self._slot(r.block_ids, pos))
                assert got == chain[pos], f"{r.req_id}: stale KV at position {pos}"

    def step(
        self,
        sample: Callable[[str], int] = lambda request_id: 7,
        stopped: Mapping[str, int | str | None] | None = None,
    ) -> tuple[SchedulerOutput, list[RequestUpdate]]:
        """One full step: schedule, check, execute, feed the sampled tokens back."""
        scheduler = self.scheduler
        out = scheduler.schedule()
        scheduler.check_invariants()
        self.check_output(out)
        self.execute(out)
        sampled = {r.req_id: [sample(r.req_id)] for r in out.requests if r.sample}
        updates = scheduler.update_from_output(sampled, stopped)
        scheduler.check_invariants()
        for update in updates:
            self.tokens[update.req_id].extend(update.new_token_ids)
            if update.finish_reason is not None:
                self.forget(update.req_id)
        return out, updates

    def forget(self, request_id: str) -> None:
        self.tokens.pop(request_id, None)
        self.salts.pop(request_id, None)
        self.expected.pop(request_id, None)

    def crash(self) -> None:
        """The worker died: its KV cache is gone."""
        self.kv.clear()

    def drain(self, max_steps: int = 10_000) -> int:
        """Step until every request has finished; return the number of steps."""
        for steps in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return steps
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")
