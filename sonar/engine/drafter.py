"""The drafts a worker makes for speculative decoding: a draft model (``method: draft_model``, a
second, smaller model that guesses the target's next tokens) or a head that guesses from the
target's hidden states (`EagleDrafter`): EAGLE (``method: eagle``), EAGLE-3 (``eagle3``, which
reads three of the target's layers) or DeepSeek's multi-token-prediction layer (``mtp``).

Either shares the target's block tables: its own KV cache has as many blocks of the same size, and
position ``p`` of a request lives in the same block and slot in both caches. Each step a draft model

1. computes the step's tokens too (`observe`: prompt chunks, last tokens, the drafts being
   verified), so its KV covers every position the target computed, through the same prefix cache
   blocks, preemptions and recomputes as the target's;
2. after the runner verified the step, decodes greedily from each sampling request's last kept
   token (`propose`): ``k`` batched one-token passes, writing KV for the kept token and the drafts
   but the last. The scheduler allocated ``k`` slots past each sampling step's tokens for them
   (`sonar.core.speculative.SpeculativeConfig.lookahead`); a request whose table holds fewer gets
   fewer drafts.

Drafts are single tokens (the draft's argmax), so the runner's verification stays exact rejection
sampling (`sonar.core.speculative`).

A draft model split over the target's tensor ranks (``draft_tensor_parallel_size``) runs on every
rank of the group, each holding its shards and the KV heads of its share (as the target's split,
`sonar.models.parallel`). Every rank computes the same step with the same kept tokens (the
sampler's, shared), and the all-gathered logits are the same on each, so each rank picks the same
drafts in step; the sampler's go back with the step's result.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sonar.core.outputs import ScheduledRequest
from sonar.core.speculative import SpeculativeConfig
from sonar.engine import memory
from sonar.kernels.attention import AttentionMetadata, allocate_kv_caches
from sonar.log import get_logger
from sonar.models.deepseek_mtp import load_mtp_head
from sonar.models.eagle import load_eagle_head
from sonar.models.eagle3 import load_eagle3_head
from sonar.models.errors import ModelLoadError
from sonar.models.head_vocab import HeadVocab
from sonar.models.loader import LoadedModel, load_model
from sonar.models.parallel import SINGLE, ParallelLayoutError, TensorParallel

log = get_logger("sonar.drafter")


@dataclass(frozen=True, slots=True)
class DraftStart:
    """Where a request's drafts start: its last kept token, that token's position, its blocks."""

    token: int
    position: int
    block_ids: list[int]


@dataclass(frozen=True, slots=True)
class StepView:
    """What a step computed, for a drafter."""

    requests: list[ScheduledRequest]
    first_rows: list[int]
    """The row of each request's first token in the step's batch."""
    ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    hidden: torch.Tensor
    """The target's final hidden states, a row per token."""
    kept: dict[str, list[int]]
    """The tokens each sampling request kept (its accepted drafts, then its sampled token)."""
    next_tokens: dict[str, int]
    """For a request whose chunk samples nothing: the known token after the chunk."""

    def last_known(self, sched: ScheduledRequest) -> int:
        """The position of the request's last known token in the step (its drafts follow it)."""
        return sched.start_pos + len(sched.token_ids) - 1 - sched.num_drafts


class _DraftKV:
    """A draft's own KV cache over the target's block tables."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, device: torch.device):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.block_size = block_size
        self.device = device
        self.kv_caches: list[torch.Tensor] = []

    def kv_bytes_per_block(self, dtype: torch.dtype) -> int:
        return memory.kv_bytes_per_block(self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, dtype)

    def allocate(self, num_blocks: int, dtype: torch.dtype, max_model_len: int) -> None:
        """`num_blocks` blocks, as many as the target's, of `dtype` (what ``--kv-cache-dtype``
        makes of the draft's own dtype)."""
        self.kv_caches = allocate_kv_caches(
            self.num_layers, num_blocks, self.block_size, self.num_kv_heads, self.head_dim, dtype, self.device
        )

    def _room(self, position: int, block_ids: list[int], k: int) -> int:
        """Drafts that fit after a start at `position`: one slot each but the last's."""
        return max(0, min(k, len(block_ids) * self.block_size - position))

    def _decode_meta(self, positions: list[int], tables: list[list[int]]) -> AttentionMetadata:
        return AttentionMetadata.build(
            [1] * len(positions), [p + 1 for p in positions], tables, self.block_size, device=self.device
        )


class Drafter(_DraftKV):
    def __init__(
        self,
        spec: SpeculativeConfig,
        *,
        dtype: str,
        device: torch.device,
        vocab_size: int,
        block_size: int,
        parallel: TensorParallel = SINGLE,
    ) -> None:
        """`parallel`: the tensor rank whose shards of the draft this process holds
        (``draft_tensor_parallel_size`` > 1: the target's own; every rank of the group then
        drafts each step, in step, for the collectives of the draft's layers)."""
        if spec.model is None:
            raise ModelLoadError("speculative method draft_model needs a model (--spec-model)")
        self.k = spec.num_speculative_tokens
        try:
            self.loaded: LoadedModel = load_model(
                spec.model,
                dtype=dtype,
                revision=spec.revision,
                device=device,
                quantization=spec.quantization,
                parallel=parallel,
            )
        except ParallelLayoutError as exc:
            raise ParallelLayoutError(
                f"the draft model {spec.model!r}: {exc}; with draft_tensor_parallel_size 1 it runs whole on one rank"
            ) from None
        self.model = self.loaded.model
        super().__init__(self.model.num_layers, self.model.num_kv_heads, self.model.head_dim, block_size, device)
        draft_vocab = int(self.loaded.config.vocab_size)
        if draft_vocab != vocab_size:
            raise ModelLoadError(
                f"the draft model {spec.model!r} has a vocabulary of {draft_vocab} tokens, the target {vocab_size}: "
                "a draft model must share the target's tokenizer"
            )
        self.vocab_size = vocab_size
        log.info(
            "drafter.loaded",
            model=self.loaded.source,
            architecture=self.loaded.architecture,
            tensor_parallel=parallel.size,
            dtype=str(self.loaded.dtype).removeprefix("torch."),
            seconds=round(self.loaded.load_seconds, 2),
        )

    def allocate(self, num_blocks: int, dtype: torch.dtype, max_model_len: int) -> None:
        if self.loaded.max_model_len < max_model_len:
            raise ModelLoadError(
                f"the draft model {self.loaded.source!r} reaches {self.loaded.max_model_len} positions, fewer "
                f"than the target's max_model_len {max_model_len}; lower --max-model-len"
            )
        super().allocate(num_blocks, dtype, max_model_len)

    def draft(self, view: StepView) -> dict[str, list[int]]:
        """Compute the step's tokens, then the drafts after each sampling request's last kept token."""
        self.observe(view.ids, view.positions, view.meta)
        ids, starts = [], []
        for sched in view.requests:
            kept = view.kept.get(sched.req_id)
            if sched.sample and kept:
                ids.append(sched.req_id)
                starts.append(DraftStart(kept[-1], view.last_known(sched) + len(kept), sched.block_ids))
        return {rid: guesses for rid, guesses in zip(ids, self.propose(starts)) if guesses}

    @torch.inference_mode()
    def observe(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """Compute the step's tokens, for their KV (the hidden states are dropped)."""
        self.model(ids, positions, self.kv_caches, meta)

    @torch.inference_mode()
    def propose(self, starts: list[DraftStart]) -> list[list[int]]:
        """Up to ``k`` drafts after each start, as far as its block table has room (one fewer
        slot than drafts: the last draft's KV is written by the step that verifies it)."""
        drafts: list[list[int]] = [[] for _ in starts]
        room = [self._room(s.position, s.block_ids, self.k) for s in starts]
        tokens = [s.token for s in starts]
        live = [i for i, r in enumerate(room) if r > 0]
        for step in range(self.k):
            live = [i for i in live if room[i] > step]
            if not live:
                break
            positions = [starts[i].position + step for i in live]
            meta = self._decode_meta(positions, [starts[i].block_ids for i in live])
            hidden = self.model(
                torch.tensor([tokens[i] for i in live], device=self.device),
                torch.tensor(positions, device=self.device),
                self.kv_caches,
                meta,
            )
            logits = self.model.compute_logits(hidden)[:, : self.vocab_size]
            for i, token in zip(live, logits.argmax(dim=-1).tolist()):
                drafts[i].append(token)
                tokens[i] = token
        return drafts


def _pair(out: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A head's (states its logits read, states fed back to its next draft): EAGLE's are one."""
    return out if isinstance(out, tuple) else (out, out)


class EagleDrafter(_DraftKV):
    """``method: eagle``, ``eagle3`` or ``mtp``: a head (`sonar.models.eagle`,
    `sonar.models.eagle3`, `sonar.models.deepseek_mtp`) on the target's hidden states.

    Each step it runs over the positions the target computed, each with the token after it (the
    known next token of a prompt chunk, the kept tokens of a sampling request: a rejected draft's
    position is left out) and the target's features there (`target_features`: the final hidden
    state, or EAGLE-3's fused layers); the last such row of a sampling request gives its first
    draft, and each further draft feeds the head's own output back."""

    def __init__(
        self,
        spec: SpeculativeConfig,
        *,
        target: Any,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        checkpoint: Path | None = None,
        vocab: HeadVocab | None = None,
    ):
        """`vocab`: copies of the target's embeddings and LM head (`gather_vocab`) where the
        target's are split over tensor ranks; None: the target's own."""
        self.k = spec.num_speculative_tokens
        if spec.method == "mtp":
            if checkpoint is None:
                raise ModelLoadError("speculative method mtp needs the target's checkpoint directory")
            self.head: Any = load_mtp_head(checkpoint, target, dtype, device)
            source = str(checkpoint)
        else:
            if spec.model is None:
                raise ModelLoadError(f"speculative method {spec.method} needs the head's directory (--spec-model)")
            load = load_eagle3_head if spec.method == "eagle3" else load_eagle_head
            self.head = load(spec.model, target, dtype, device)
            source = spec.model
        if vocab is not None:
            self.head.vocab = vocab
        self.vocab_size = target.vocab_size
        super().__init__(self.head.num_layers, self.head.num_kv_heads, self.head.head_dim, block_size, device)
        log.info("drafter.loaded", model=source, architecture=type(self.head).__name__, layers=self.head.num_layers)

    @torch.inference_mode()
    def draft(self, view: StepView) -> dict[str, list[int]]:
        ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        q_lens: list[int] = []
        s_lens: list[int] = []
        tables: list[list[int]] = []
        ends: list[tuple[str, int, int, list[int]]] = []  # (request, its last head row, position, blocks)
        for sched, first in zip(view.requests, view.first_rows):
            known = sched.token_ids[: len(sched.token_ids) - sched.num_drafts]
            kept = view.kept.get(sched.req_id, []) if sched.sample else []
            after = known[1:] + (kept if sched.sample else [view.next_tokens[sched.req_id]])
            if not after:
                continue
            ids += after
            positions += range(sched.start_pos, sched.start_pos + len(after))
            rows += range(first, first + len(after))
            q_lens.append(len(after))
            s_lens.append(sched.start_pos + len(after))
            tables.append(sched.block_ids)
            if kept:
                ends.append((sched.req_id, len(ids) - 1, sched.start_pos + len(after) - 1, sched.block_ids))
        if not ids:
            return {}
        device = self.device
        meta = AttentionMetadata.build(q_lens, s_lens, tables, self.block_size, device=device)
        features = self.head.target_features(view.hidden, torch.tensor(rows, device=device))
        states, fed = _pair(
            self.head(
                torch.tensor(ids, device=device), torch.tensor(positions, device=device), features, self.kv_caches, meta
            )
        )
        live = [(rid, p, blocks) for rid, _, p, blocks in ends if self._room(p, blocks, self.k) > 0]
        if not live:
            return {}
        index = {rid: row for rid, row, _, _ in ends}
        picked = torch.tensor([index[rid] for rid, _, _ in live], device=device)
        features = fed[picked]
        drafts: dict[str, list[int]] = {rid: [] for rid, _, _ in live}
        tokens = self.head.greedy(states[picked])
        for step in range(1, self.k + 1):
            for (rid, _, _), token in zip(live, tokens.tolist()):
                drafts[rid].append(token)
            keep = [i for i, (_, p, blocks) in enumerate(live) if step < self._room(p, blocks, self.k)]
            if not keep:
                break
            live = [live[i] for i in keep]
            picked = torch.tensor(keep, device=device)
            tokens, features = tokens[picked], features[picked]
            positions = [p + step for _, p, _ in live]
            meta = self._decode_meta(positions, [blocks for _, _, blocks in live])
            states, features = _pair(
                self.head(tokens, torch.tensor(positions, device=device), features, self.kv_caches, meta)
            )
            tokens = self.head.greedy(states)
        return drafts
