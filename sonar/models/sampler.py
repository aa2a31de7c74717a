"""Batched sampling: one call turns the step's logits `[num_seqs, vocab]` into next tokens.

The worker gathers every running request's `SamplingParams` into a `SamplingBatch` once per
step (per-request values become `[num_seqs]` tensors, per-token features become flat indices
into the `[num_seqs * vocab]` logits) and calls `Sampler()(logits, batch)`. The per-request
Python work is in `SamplingBatch.build`; the sampler itself only loops over seeded rows, one
generator call each, to draw their uniform number.

Order of operations on each row:

1. raw logits → float32 copy (the caller's tensor is never modified);
2. repetition penalty (prompt + output tokens), then frequency and presence penalties (output
   tokens only), then `logit_bias` (added as given, after the penalties), then `min_tokens`
   (EOS and `stop_token_ids` set to -inf);
3. greedy rows: argmax of these logits;
4. other rows: divide by temperature, then `min_p`, `top_k`, `top_p` (vLLM's order), then draw
   by inverting the row's cumulative distribution with one uniform number: the first token whose
   running probability sum exceeds ``u * total`` is token i with probability p_i. (One random
   number per row, not one per logit as an exponential race needs: 0.7 instead of 3.8 ms for 16
   rows of SmolLM2's 49152 logits on 2 cores.)

Extreme but valid values never turn a row into nothing: the repetition penalty's result stops at
the largest float, temperature divides the logits relative to the row's best one, and a logit at
+inf counts as the largest float (such tokens share the row's mass). A row where no token can be
drawn (every logit -inf after the steps above, or NaN: a broken row of the model's output) is not
sampled: its `SamplerOutput.failed` entry is true and its id is 0, a valid token that a step
already scheduled behind this one can feed without harm, so one bad row never fails the batch or
puts an id outside the vocabulary into the next step. The caller fails that request alone
(`sonar.engine.runner`).

Logprobs are those of the *raw* model output (log-softmax before penalties, bias, temperature
and truncation), like vLLM's default: they describe the model, not the sampling settings.

Seeded requests do not keep a generator from step to step: each step a generator is seeded
from a hash of (seed, output position) and draws that row's number alone. So a seeded request
gives the same tokens alone or in any batch at any position, and again after a preemption
(recompute) or a worker restart. The position is the number of output tokens the request
already has. (CPU and GPU generators differ, so the same seed may give other tokens on another
kind of device.)
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from sonar.kernels import ops
from sonar.sampling_params import GREEDY_EPS, SamplingParams

_NEG_INF = float("-inf")
_FLOAT_MAX = torch.finfo(torch.float32).max

#: How many of a row's most likely tokens are ranked to find its top-p cutoff (see
#: `apply_truncation`); more only when the top-p mass is not among them.
TOP_P_CANDIDATES = 1024


@dataclass
class LogprobsTensors:
    """Logprobs of one token per row plus the row's top-N.

    Column 0 of `token_ids`/`logprobs` is the sampled (or, for prompts, the actual) token;
    columns 1..N are the N most likely tokens, most likely first. `ranks` is the rank of the
    column-0 token in its row (1 = most likely).
    """

    token_ids: torch.Tensor  # [rows, 1 + N] int64
    logprobs: torch.Tensor  # [rows, 1 + N] float32
    ranks: torch.Tensor  # [rows] int64


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [num_seqs] int64, each in [0, vocab)
    #: None when no request of the batch asked for logprobs. Otherwise N is the largest
    #: `logprobs` in the batch; a request that asked for fewer uses the first 1 + its N columns.
    logprobs: LogprobsTensors | None
    #: [num_seqs] bool: rows where no token could be drawn (their id is 0).
    failed: torch.Tensor


@dataclass
class SamplingBatch:
    """The per-step sampling inputs of a batch, as tensors. Build it with `SamplingBatch.build`.

    Optional tensors are None when no row of the batch uses the feature, so a plain batch pays
    for nothing it does not use. Flat indices address the logits viewed as `[num_seqs * vocab]`.
    """

    num_seqs: int
    vocab_size: int
    all_greedy: bool
    greedy: torch.Tensor | None  # [B] bool; None when no row is greedy
    temperature: torch.Tensor  # [B] float32; 1.0 on greedy rows
    top_k: torch.Tensor | None  # [B] int64; vocab_size where off
    top_k_max: int  # the largest active k (0 when none)
    top_p: torch.Tensor | None  # [B] float32; 1.0 where off
    min_p: torch.Tensor | None  # [B] float32; 0.0 where off
    repetition_penalty: torch.Tensor | None  # [B] float32
    presence_penalty: torch.Tensor | None  # [B] float32
    frequency_penalty: torch.Tensor | None  # [B] float32
    prompt_index: torch.Tensor | None  # flat indices of prompt tokens (repetition penalty rows)
    output_index: torch.Tensor | None  # flat indices of output tokens (penalised rows), repeated
    bias_index: torch.Tensor | None
    bias_value: torch.Tensor | None
    blocked_index: torch.Tensor | None  # min_tokens: flat indices forced to -inf
    #: (row, generator seed derived from the request's seed and position) of seeded rows.
    seeded_rows: list[tuple[int, int]]
    any_unseeded_random: bool
    max_num_logprobs: int | None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        output_token_ids: Sequence[Sequence[int]],
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        *,
        vocab_size: int,
        eos_token_ids: Sequence[int] = (),
        device: torch.device | str | None = None,
    ) -> "SamplingBatch":
        """Gather the batch's params into tensors (once per step).

        `output_token_ids[i]` are the tokens request `i` generated so far (its length is the
        position used for seeded noise and `min_tokens`); `prompt_token_ids` is needed only
        when some row has a repetition penalty. `eos_token_ids` are blocked by `min_tokens`
        unless the request has `ignore_eos`. Params are trusted: run
        `SamplingParams.validate` before admitting a request.
        """
        num_seqs = len(params)
        if len(output_token_ids) != num_seqs:
            raise ValueError(f"{num_seqs} params but {len(output_token_ids)} output token lists")
        vocab = vocab_size
        temperature: list[float] = []
        greedy: list[bool] = []
        top_k: list[int] = []
        top_p: list[float] = []
        min_p: list[float] = []
        rep: list[float] = []
        pres: list[float] = []
        freq: list[float] = []
        prompt_parts: list[np.ndarray] = []
        output_parts: list[np.ndarray] = []
        bias_index: list[int] = []
        bias_value: list[float] = []
        blocked: list[int] = []
        seeded_rows: list[tuple[int, int]] = []
        any_unseeded_random = False
        max_num_logprobs: int | None = None

        for row, (p, out) in enumerate(zip(params, output_token_ids)):
            base = row * vocab
            is_greedy = p.temperature < GREEDY_EPS
            greedy.append(is_greedy)
            if is_greedy:
                temperature.append(1.0)
                top_k.append(vocab)
                top_p.append(1.0)
                min_p.append(0.0)
            else:
                temperature.append(p.temperature)
                top_k.append(p.top_k if 0 < p.top_k < vocab else vocab)
                top_p.append(p.top_p)
                min_p.append(p.min_p)
                if p.seed is None:
                    any_unseeded_random = True
                else:
                    seeded_rows.append((row, step_seed(p.seed, len(out))))
            rep.append(p.repetition_penalty)
            pres.append(p.presence_penalty)
            freq.append(p.frequency_penalty)
            if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
                if len(out):
                    output_parts.append(np.asarray(out, dtype=np.int64) + base)
                if p.repetition_penalty != 1.0:
                    if prompt_token_ids is None:
                        raise ValueError("repetition_penalty needs prompt_token_ids")
                    prompt = prompt_token_ids[row]
                    if len(prompt):
                        prompt_parts.append(np.asarray(prompt, dtype=np.int64) + base)
            if p.logit_bias:
                for token_id, bias in p.logit_bias.items():
                    bias_index.append(base + token_id)
                    bias_value.append(bias)
            if len(out) < p.min_tokens:
                stops = set(p.stop_token_ids or ())
                if not p.ignore_eos:
                    stops.update(eos_token_ids)
                blocked.extend(base + t for t in stops)
            if p.logprobs is not None:
                max_num_logprobs = max(max_num_logprobs or 0, p.logprobs)

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        def flat(parts: list[np.ndarray]) -> torch.Tensor | None:
            if not parts:
                return None
            return torch.from_numpy(np.concatenate(parts)).to(device)

        def longs(values: list[int]) -> torch.Tensor | None:
            return torch.tensor(values, dtype=torch.int64, device=device) if values else None

        active_k = [k for k in top_k if k < vocab]
        all_greedy = all(greedy)
        return cls(
            num_seqs=num_seqs,
            vocab_size=vocab,
            all_greedy=all_greedy,
            greedy=torch.tensor(greedy, device=device) if any(greedy) else None,
            temperature=floats(temperature).clamp_(max=_FLOAT_MAX),  # inf in float32 makes -inf / inf NaN
            top_k=longs(top_k) if active_k else None,
            top_k_max=max(active_k, default=0),
            top_p=floats(top_p) if any(v < 1.0 for v in top_p) else None,
            min_p=floats(min_p) if any(v > 0.0 for v in min_p) else None,
            # in float32 a valid 1e-300 would be 0 and 1e300 inf (0 / 0, 0 * inf: NaN logits)
            repetition_penalty=(
                floats(rep).clamp_(min=torch.finfo(torch.float32).tiny, max=_FLOAT_MAX)
                if any(v != 1.0 for v in rep)
                else None
            ),
            presence_penalty=floats(pres) if any(pres) else None,
            frequency_penalty=floats(freq) if any(freq) else None,
            prompt_index=flat(prompt_parts),
            output_index=flat(output_parts),
            bias_index=longs(bias_index),
            bias_value=floats(bias_value) if bias_value else None,
            blocked_index=longs(blocked),
            seeded_rows=seeded_rows,
            any_unseeded_random=any_unseeded_random,
            max_num_logprobs=max_num_logprobs,
        )


def is_plain_greedy(params: SamplingParams) -> bool:
    """Whether the argmax of the raw logits is this request's whole sampling step, at every
    position: greedy, no penalty, bias, `min_tokens` or logprobs. A batch of such requests
    needs no `SamplingBatch` (see `Sampler.greedy`)."""
    return (
        params.greedy
        and params.repetition_penalty == 1.0
        and not params.presence_penalty
        and not params.frequency_penalty
        and not params.logit_bias
        and params.min_tokens == 0
        and params.logprobs is None
    )


class Sampler:
    """Turns logits into tokens for a `SamplingBatch`. Holds no per-request state.

    `generator` drives the noise of unseeded requests (the default torch generator if None).
    """

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator
        self._seeded: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape != (batch.num_seqs, batch.vocab_size):
            raise ValueError(
                f"logits of shape {tuple(logits.shape)} for a batch of {batch.num_seqs} x {batch.vocab_size}"
            )
        x = logits.to(torch.float32, copy=True, memory_format=torch.contiguous_format)
        x = apply_penalties(x, batch)

        greedy_ids = greedy_failed = None
        if batch.greedy is not None:
            best, greedy_ids = ops.row_max(x)
            greedy_failed = ~(best > _NEG_INF)  # all -inf, or NaN (which max propagates)
        if batch.all_greedy:
            assert greedy_ids is not None and greedy_failed is not None
            sampled, failed = greedy_ids, greedy_failed
        else:
            # Relative to the row's best logit before dividing (softmax and truncation do not
            # change): a tiny temperature cannot overflow a row into all -inf or +inf. A logit at
            # +inf counts as the largest float, so such tokens share the mass instead of turning
            # the row into NaN.
            x.clamp_(max=_FLOAT_MAX)
            x.sub_(x.amax(dim=-1, keepdim=True)).div_(batch.temperature.unsqueeze(1))
            x = apply_truncation(x, batch)
            cdf = torch.softmax(x, dim=-1).cumsum_(dim=-1)
            total = cdf[:, -1:]
            # u * total can round up to total (u just below 1): the largest float below total is
            # still under the last nonzero token's running sum, never past it
            target = torch.minimum(self._uniforms(x, batch) * total, torch.nextafter(total, torch.zeros_like(total)))
            sampled = torch.searchsorted(cdf, target, right=True).squeeze(1)
            # softmax of a row with nothing left (all -inf, NaN, +inf) sums to NaN, not ~1
            failed = ~(total.squeeze(1) > 0)
            if greedy_ids is not None:
                assert batch.greedy is not None and greedy_failed is not None
                sampled = torch.where(batch.greedy, greedy_ids, sampled)
                failed = torch.where(batch.greedy, greedy_failed, failed)
        sampled, failed = _only_in_vocabulary(sampled, failed, batch.vocab_size)

        logprobs = None
        if batch.max_num_logprobs is not None:
            raw = torch.log_softmax(logits.float(), dim=-1)
            logprobs = gather_logprobs(raw, sampled, batch.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs, failed=failed)

    @staticmethod
    def greedy(logits: torch.Tensor) -> SamplerOutput:
        """The fast path for a batch of `is_plain_greedy` requests: the argmax of each row
        (the same token the full path picks for them); a row of NaN or -inf fails."""
        best, ids = ops.row_max(logits)
        sampled, failed = _only_in_vocabulary(ids, ~(best > _NEG_INF), logits.shape[-1])
        return SamplerOutput(sampled_token_ids=sampled, logprobs=None, failed=failed)

    def _uniforms(self, x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """One uniform number in [0, 1) per row ``[num_seqs, 1]``: the sampler's generator for
        unseeded rows, a generator seeded for the step for each seeded row (a loop over those
        rows only)."""
        rows = x.shape[0]
        if batch.any_unseeded_random:
            u = torch.rand((rows, 1), generator=self.generator, device=x.device)
        else:
            u = torch.full((rows, 1), 0.5, device=x.device)
        if batch.seeded_rows:
            generator = self._seeded.get(x.device)
            if generator is None:
                generator = self._seeded[x.device] = torch.Generator(device=x.device)
            for row, seed in batch.seeded_rows:
                generator.manual_seed(seed)
                u[row].uniform_(generator=generator)
        return u


def _only_in_vocabulary(sampled: torch.Tensor, failed: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Any id outside [0, vocab) fails its row too; failed rows get id 0."""
    failed = failed | (sampled < 0) | (sampled >= vocab)
    return sampled.masked_fill(failed, 0), failed


def apply_penalties(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Penalties, `logit_bias` and `min_tokens` on contiguous float32 logits `[B, V]`.

    Returns the result, which may be `x` changed in place.
    """
    flat = x.view(-1)
    size = flat.numel()
    if batch.repetition_penalty is not None:
        seen = torch.zeros(size, dtype=torch.bool, device=x.device)
        if batch.prompt_index is not None:
            seen[batch.prompt_index] = True
        if batch.output_index is not None:
            seen[batch.output_index] = True
        seen = seen.view_as(x)
        rp = batch.repetition_penalty.unsqueeze(1)
        # a penalty shifts, never masks: an extreme one (1e-300, 1e300) stops at the largest float
        penalised = torch.where(x > 0, x / rp, x * rp).clamp_(-_FLOAT_MAX, _FLOAT_MAX)
        x = torch.where(seen, penalised, x)
        flat = x.view(-1)
    if (batch.presence_penalty is not None or batch.frequency_penalty is not None) and batch.output_index is not None:
        counts = torch.zeros(size, dtype=torch.float32, device=x.device)
        ones = torch.ones(batch.output_index.shape, dtype=torch.float32, device=x.device)
        counts.index_add_(0, batch.output_index, ones)
        counts = counts.view_as(x)
        if batch.frequency_penalty is not None:
            x.sub_(batch.frequency_penalty.unsqueeze(1) * counts)
        if batch.presence_penalty is not None:
            x.sub_(batch.presence_penalty.unsqueeze(1) * (counts > 0))
    if batch.bias_index is not None:
        assert batch.bias_value is not None
        flat.index_add_(0, batch.bias_index, batch.bias_value)
    if batch.blocked_index is not None:
        flat.index_fill_(0, batch.blocked_index, _NEG_INF)
    return x


def apply_truncation(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """`min_p`, then `top_k`, then `top_p` on temperature-scaled logits: masked entries → -inf.

    `top_p` keeps the smallest set of most likely tokens whose probability (renormalised after
    top-k) reaches p, and always at least one token. Both come down to a per-row cutoff logit;
    ties with the cutoff are kept. Instead of sorting the whole vocabulary, the cutoffs are
    found among the `TOP_P_CANDIDATES` most likely tokens, with a full sort only for a batch
    where some row's top-p set does not fit there (a very flat distribution).
    """
    if batch.min_p is not None:
        probs = torch.softmax(x, dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * batch.min_p.unsqueeze(1)
        x = x.masked_fill(probs < threshold, _NEG_INF)
    if batch.top_k is None and batch.top_p is None:
        return x
    vocab = x.shape[1]
    if batch.top_p is None:
        candidates = batch.top_k_max
    else:
        candidates = min(vocab, max(batch.top_k_max, TOP_P_CANDIDATES))
    found = _cutoffs(x, batch, candidates)
    if found is None:
        found = _cutoffs(x, batch, vocab)
        assert found is not None
    cutoff, active = found
    return x.masked_fill((x < cutoff) & active, _NEG_INF)


def _cutoffs(x: torch.Tensor, batch: SamplingBatch, candidates: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per-row cutoff logits `[B, 1]` and which rows truncate at all `[B, 1]`.

    None when `candidates` is less than the vocabulary and a top-p row needs more tokens.
    """
    rows, vocab = x.shape
    if candidates < vocab:
        top = x.topk(candidates, dim=-1).values
    else:
        top = x.sort(dim=-1, descending=True).values
    keep = torch.full((rows,), candidates, dtype=torch.int64, device=x.device)
    active = torch.zeros(rows, dtype=torch.bool, device=x.device)
    k_on = None
    if batch.top_k is not None:
        k_on = batch.top_k < vocab
        keep = torch.minimum(keep, batch.top_k)
        active |= k_on
    if batch.top_p is not None:
        ranked = top
        normaliser = x.logsumexp(dim=-1)
        if k_on is not None:
            positions = torch.arange(candidates, device=x.device)
            ranked = top.masked_fill(positions >= keep.unsqueeze(1), _NEG_INF)
            normaliser = torch.where(k_on, ranked.logsumexp(dim=-1), normaliser)
        probs = (ranked - normaliser.unsqueeze(1)).exp_()
        cumulative = probs.cumsum(dim=-1)
        p = batch.top_p
        p_on = p < 1.0
        if candidates < vocab and bool(((cumulative[:, -1] < p) & p_on).any()):
            return None
        # A token is kept while the mass of the tokens ranked above it is still below p.
        needed = ((cumulative - probs) < p.unsqueeze(1)).sum(dim=-1).clamp_(min=1)
        keep = torch.where(p_on, torch.minimum(keep, needed), keep)
        active |= p_on
    cutoff = top.gather(1, (keep - 1).clamp_(max=candidates - 1).unsqueeze(1))
    return cutoff, active.unsqueeze(1)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """Column 0: the logprob of `token_ids[i]` in row i; then the row's top `num_logprobs`."""
    token_ids = token_ids.to(torch.int64)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    if num_logprobs > 0:
        top = logprobs.topk(num_logprobs, dim=-1)
        ids = torch.cat([token_ids.unsqueeze(1), top.indices], dim=1)
        values = torch.cat([chosen, top.values], dim=1)
    else:
        ids, values = token_ids.unsqueeze(1), chosen
    return LogprobsTensors(token_ids=ids, logprobs=values, ranks=ranks)


def compute_prompt_logprobs(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    num_logprobs: int,
    *,
    chunk_rows: int = 1024,
) -> LogprobsTensors:
    """Logprob of each prompt token given its prefix, plus the top `num_logprobs` (for `echo`).

    Row t of `logits` is the model output at prompt position t, which predicts `target_ids[t]`:
    pass the logits of positions 0..L-2 with targets `prompt[1:]` (the first prompt token has
    no logprob). Raw model logprobs, like the sampler's; computed `chunk_rows` rows at a time so
    a long prompt does not need a float32 `[L, vocab]` copy all at once.
    """
    if logits.shape[0] != target_ids.shape[0]:
        raise ValueError(f"{logits.shape[0]} logit rows for {target_ids.shape[0]} targets")
    parts = [
        gather_logprobs(
            torch.log_softmax(logits[i : i + chunk_rows].float(), dim=-1),
            target_ids[i : i + chunk_rows],
            num_logprobs,
        )
        for i in range(0, logits.shape[0], chunk_rows)
    ]
    if len(parts) == 1:
        return parts[0]
    if not parts:
        empty = torch.empty(0, 1 + num_logprobs, device=logits.device)
        return LogprobsTensors(token_ids=empty.long(), logprobs=empty, ranks=empty[:, 0].long())
    return LogprobsTensors(
        token_ids=torch.cat([p.token_ids for p in parts]),
        logprobs=torch.cat([p.logprobs for p in parts]),
        ranks=torch.cat([p.ranks for p in parts]),
    )


def step_seed(seed: int, position: int) -> int:
    """The generator seed for a seeded request's draw at one output position (64 bits)."""
    material = seed.to_bytes(16, "little", signed=True) + position.to_bytes(8, "little")
    digest = hashlib.blake2b(material, digest_size=8, person=b"sonar-sample").digest()
    return int.from_bytes(digest, "little")
