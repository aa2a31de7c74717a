"""A fake model runner for scheduler tests: a KV cache of fingerprints, checked on every read.

The "KV" written at position ``p`` of a request is a fingerprint of the request's salt and
tokens ``0..p``, computed the way attention would: from the fingerprint already in the cache
at ``p - 1`` and token ``p``. Before each step's reads, the runner checks every position a
request attends to against the fingerprints its own tokens imply, so a wrongly shared,
evicted, overwritten or never-computed block fails the test at once.

Like the real runner, it keeps each request's tokens as it knows them (``seq``: the prompt, then
every token it sampled) and puts those in for `PLACEHOLDER_TOKEN`. ``step`` is the synchronous
loop; ``step_async`` schedules and runs step N+1 before it feeds back step N's tokens, as the
scheduler actor does with async scheduling.

A multi-step decode (`SchedulerOutput.decode_steps`) runs as that many decode steps back to back,
each feeding the token the one before sampled; ``cut`` stands for a worker that stops it early.

With worker drafts (`SchedulerConfig.worker_drafts`), ``propose`` stands for the worker's proposer:
a step's draft slots are filled, as the real runner does, after the request's last sampled token,
which is where the kept tokens end rather than where the scheduler placed the step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import msgspec

from sonar.core.outputs import PLACEHOLDER_TOKEN, RequestUpdate, SchedulerOutput
from sonar.core.request import Request
from sonar.core.schedule import Scheduler

Fingerprint = int


def fingerprint(prev: Fingerprint | None, token: int, salt: object) -> Fingerprint:
    """The KV of `token` after `prev`; a first token's also depends on `salt` (the request's cache
    salt, LoRA adapter and LongRoPE factor set: KV computed under another adapter, or rotated with
    the other factors, is another KV)."""
    return hash((prev, token)) if prev is not None else hash((salt, token))


class FakeRunner:
    """Simulates the worker's KV cache and checks each step the scheduler produces."""

    def __init__(
        self,
        scheduler: Scheduler,
        propose: Callable[[list[int], int], list[int]] | None = None,
        cut: Callable[[int], int] | None = None,
        ahead: Callable[[int], int] | None = None,
    ) -> None:
        """`propose`: with worker drafts, up to ``n`` drafts after a request's tokens. `cut`: how many
        of a multi-step decode's ``n`` steps run (all of them without it). `ahead`: how many of the
        ``n`` decode steps that ran are fed back one by one before the result (`StepTokens`, at
        most ``n - 1``: the last one's tokens only come with it); none without it."""
        self.scheduler = scheduler
        self.propose = propose
        self.cut = cut
        self.ahead = ahead
        self.multi_steps = 0
        """Multi-step decodes run."""
        self.streamed_steps = 0
        """Decode steps of multi-step decodes fed back ahead of their result."""
        self.ran = 1
        """The decode steps the last step run ran."""
        self.drafted: dict[str, int] = {}
        """Worker drafts: how many drafts each request of the last step run got."""
        self.block_size = scheduler.block_manager.block_size
        self.kv: dict[tuple[int, int], Fingerprint] = {}
        self.tokens: dict[str, list[int]] = {}
        """The scheduler's tokens of each request, as its updates said."""
        self.seq: dict[str, list[int]] = {}
        """The runner's: the prompt, then each token it sampled (one past a stop, in async mode)."""
        self.in_flight: dict[str, list[int]] | None = None
        """step_async: the tokens of the step run but not yet fed back."""
        self.salts: dict[str, tuple[str | None, str | None, bool]] = {}
        self.expected: dict[str, list[Fingerprint]] = {}

    def add(self, request: Request) -> None:
        """Add ``request`` to the scheduler and remember its tokens independently."""
        self.scheduler.add_request(request)
        self.tokens[request.request_id] = list(request.prompt_token_ids)
        self.seq[request.request_id] = list(request.prompt_token_ids)
        self.salts[request.request_id] = (request.cache_salt, request.lora_key, request.long_rope)
        self.expected[request.request_id] = []

    def _expected(self, request_id: str, upto: int) -> list[Fingerprint]:
        chain = self.expected[request_id]
        tokens = self.seq[request_id]
        salt = self.salts[request_id]
        while len(chain) < upto:
            prev = chain[-1] if chain else None
            chain.append(fingerprint(prev, tokens[len(chain)], salt))
        return chain

    def _slot(self, block_ids: Sequence[int], pos: int) -> tuple[int, int]:
        return block_ids[pos // self.block_size], pos % self.block_size

    def check_output(self, out: SchedulerOutput) -> None:
        config = self.scheduler.config
        steps = out.decode_steps
        total = sum(len(r.token_ids) for r in out.requests)
        assert total <= config.max_num_batched_tokens
        assert total + (steps - 1) * len(out.requests) == out.num_scheduled_tokens
        if steps > 1:  # plain decodes, each with room for all its steps
            assert all(len(r.token_ids) == 1 and r.sample and not r.num_drafts for r in out.requests), out
            for r in out.requests:
                assert len(r.block_ids) * self.block_size >= r.start_pos + steps, r
                assert config.max_model_len >= r.start_pos + 1 + steps, r
        assert len(out.requests) <= config.max_num_seqs
        assert len({r.req_id for r in out.requests}) == len(out.requests)
        for r in out.requests:
            if r.is_new:  # the runner (re)builds its state from the scheduler's tokens
                self.seq[r.req_id] = list(self.tokens[r.req_id])
                self.expected[r.req_id] = []
            salt = self.salts[r.req_id]
            if salt[2] != r.long_rope:  # LongRoPE: the factor set changes with a recompute only
                assert r.is_new, f"{r.req_id}: factor set changed without a recompute"
                self.salts[r.req_id] = (*salt[:2], r.long_rope)
            switch = config.longrope_switch
            assert switch is None or r.long_rope or r.start_pos + len(r.token_ids) <= switch, r
            tokens = self.seq[r.req_id]
            end = r.start_pos + len(r.token_ids)
            assert r.token_ids, r
            assert not r.num_drafts or r.sample, r
            end -= r.num_drafts  # the drafts follow the known tokens
            assert end <= len(tokens), f"{r.req_id}: a placeholder the runner never sampled"
            given = r.token_ids[: len(r.token_ids) - r.num_drafts]
            known = [t if t != PLACEHOLDER_TOKEN else tokens[r.start_pos + i] for i, t in enumerate(given)]
            assert known == tokens[r.start_pos : end], r
            assert all(t == PLACEHOLDER_TOKEN for t in given[len(self.tokens[r.req_id]) - r.start_pos :]), r
            assert r.sample == (end == len(tokens)), r
            end += r.num_drafts
            assert len(r.block_ids) * self.block_size >= end, r
            assert r.num_prompt_tokens <= len(tokens)

    def execute(
        self,
        out: SchedulerOutput,
        sample: Callable[[str], int] = lambda request_id: 7,
        model: Callable[[list[int]], int] | None = None,
    ) -> dict[str, list[int]]:
        """Write the step's KV in batch order, check every read of the step, sample.

        `model`: the next token of a sequence (else `sample` gives it by request). A request with
        drafts (speculative decoding) gets a token at each of its last ``1 + num_drafts``
        positions and keeps the drafts its tokens agree with, then the first that differs."""
        if out.decode_steps > 1:
            return self._execute_steps(out, sample, model)
        for r in out.requests:
            salt = self.salts[r.req_id]
            seq = self.seq[r.req_id]
            for i in range(len(r.token_ids)):
                pos = r.start_pos + i
                token = seq[pos] if pos < len(seq) else r.token_ids[i]  # a draft past the known tokens
                prev = self.kv[self._slot(r.block_ids, pos - 1)] if pos else None
                self.kv[self._slot(r.block_ids, pos)] = fingerprint(prev, token, salt)
        for r in out.requests:
            end = r.start_pos + len(r.token_ids)
            known = min(end, len(self.seq[r.req_id]))
            chain = self._expected(r.req_id, known)[:known]
            for i in range(len(r.token_ids) - (end - known), len(r.token_ids)):  # the drafts' own KV
                chain.append(fingerprint(chain[-1] if chain else None, r.token_ids[i], self.salts[r.req_id]))
            for pos in range(end):
                got = self.kv.get(self._slot(r.block_ids, pos))
                assert got == chain[pos], f"{r.req_id}: stale KV at position {pos}"
        sampled = {}
        for r in out.requests:
            if r.sample:
                seq = self.seq[r.req_id]
                drafts = r.token_ids[len(r.token_ids) - r.num_drafts :]
                kept: list[int] = []
                for j in range(1 + len(drafts)):
                    token = model(seq + kept) if model is not None else sample(r.req_id)
                    kept.append(token)
                    if j == len(drafts) or token != drafts[j]:
                        break
                seq += kept
                sampled[r.req_id] = kept
        return sampled

    def _execute_steps(
        self, out: SchedulerOutput, sample: Callable[[str], int], model: Callable[[list[int]], int] | None
    ) -> dict[str, list[int]]:
        """A multi-step decode: its steps one after another (as many as `cut` lets run), each a
        decode of the token the one before sampled."""
        steps = out.decode_steps if self.cut is None else self.cut(out.decode_steps)
        self.multi_steps += 1
        self.ran = steps
        sampled: dict[str, list[int]] = {r.req_id: [] for r in out.requests}
        for j in range(steps):
            requests = [
                msgspec.structs.replace(r, token_ids=[self.seq[r.req_id][-1]], start_pos=r.start_pos + j)
                for r in out.requests
            ]
            for rid, tokens in self.execute(
                msgspec.structs.replace(out, requests=requests, decode_steps=1), sample, model
            ).items():
                sampled[rid] += tokens
        return sampled

    def step(
        self,
        sample: Callable[[str], int] = lambda request_id: 7,
        stopped: Mapping[str, int | str | None] | None = None,
        model: Callable[[list[int]], int] | None = None,
    ) -> tuple[SchedulerOutput, list[RequestUpdate]]:
        """One full step: schedule, check, execute, feed the sampled tokens back."""
        out = self._run(sample, model)
        return out, self._feed_back(self.in_flight or {}, stopped, self.drafted)

    def step_async(
        self,
        sample: Callable[[str], int] = lambda request_id: 7,
        stopped: Mapping[str, int | str | None] | None = None,
    ) -> tuple[SchedulerOutput, list[RequestUpdate]]:
        """Schedule and run step N+1, then feed back step N's tokens (async scheduling)."""
        previous, drafted = self.in_flight, self.drafted
        out = self._run(sample)
        current, self.in_flight = self.in_flight, None
        updates = self._feed_back(previous, stopped, drafted) if previous is not None else []
        self.in_flight = current
        return out, updates

    def _run(self, sample: Callable[[str], int], model: Callable[[list[int]], int] | None = None) -> SchedulerOutput:
        scheduler = self.scheduler
        out = scheduler.schedule()
        self.ran = 1
        scheduler.check_invariants()
        out = self._fill_draft_slots(out)
        self.check_output(out)
        self.in_flight = self.execute(out, sample, model)
        return out

    def _fill_draft_slots(self, out: SchedulerOutput) -> SchedulerOutput:
        """Worker drafts: each request with draft slots starts at its last sampled token and gets
        up to as many drafts as slots from `propose` (what the real runner does)."""
        self.drafted = {}
        if not self.scheduler.config.worker_drafts:
            return out
        requests = []
        for r in out.requests:
            # a decode after a step with draft slots: placed as if all its drafts were kept
            if r.token_ids[-1] == PLACEHOLDER_TOKEN and len(r.token_ids) == 1 + r.num_drafts:
                if r.is_new:
                    self.seq[r.req_id] = list(self.tokens[r.req_id])
                    self.expected[r.req_id] = []
                seq = self.seq[r.req_id]
                start = len(seq) - 1 if r.token_ids[0] == PLACEHOLDER_TOKEN else r.start_pos
                assert start <= r.start_pos, r
                drafts = []
                if r.num_drafts:
                    assert self.propose is not None, "draft slots without a proposer"
                    drafts = self.propose(seq, r.num_drafts)[: r.num_drafts]
                    self.drafted[r.req_id] = len(drafts)
                r = msgspec.structs.replace(
                    r, token_ids=[r.token_ids[0], *drafts], start_pos=start, num_drafts=len(drafts), is_new=False
                )
            requests.append(r)
        total = sum(len(r.token_ids) for r in requests)  # slots left empty are not computed
        return msgspec.structs.replace(out, requests=requests, num_scheduled_tokens=total)

    def _feed_back(
        self,
        sampled: dict[str, list[int]],
        stopped: Mapping[str, int | str | None] | None,
        drafted: Mapping[str, int] | None = None,
    ) -> list[RequestUpdate]:
        scheduler = self.scheduler
        self.in_flight = None
        updates = []
        ahead = self.ahead(self.ran) if self.ahead is not None and self.ran > 1 else 0
        for j in range(ahead):  # each a `StepTokens` while the multi-step decode still runs
            updates += scheduler.update_from_output({rid: t[j : j + 1] for rid, t in sampled.items()}, partial=True)
            scheduler.check_invariants()
        self.streamed_steps += ahead
        updates += scheduler.update_from_output({rid: t[ahead:] for rid, t in sampled.items()}, None, drafted)
        scheduler.check_invariants()
        for update in updates:
            self.tokens[update.req_id].extend(update.new_token_ids)
            assert self.tokens[update.req_id] == self.seq[update.req_id][: len(self.tokens[update.req_id])]
            if update.finish_reason is not None:
                self.forget(update.req_id)
        if stopped:  # stop strings the detokenizer found
            for request_id in scheduler.finish_stopped(stopped):
                self.forget(request_id)
            scheduler.check_invariants()
        return updates

    def forget(self, request_id: str) -> None:
        self.tokens.pop(request_id, None)
        self.seq.pop(request_id, None)
        self.salts.pop(request_id, None)
        self.expected.pop(request_id, None)

    def crash(self) -> None:
        """The worker died: its KV cache is gone, and the step in flight with it."""
        self.kv.clear()
        self.in_flight = None

    def drain(self, max_steps: int = 10_000) -> int:
        """Step until every request has finished; return the number of steps."""
        for steps in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                if self.in_flight is not None:
                    self._feed_back(self.in_flight, None, self.drafted)
                return steps
            self.step_async() if self.in_flight is not None else self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")
