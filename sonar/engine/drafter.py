"""The draft model of speculative decoding (``method: draft_model``): a second, smaller model in the
worker that guesses the target's next tokens.

It shares the target's block tables: its own KV cache has as many blocks of the same size, and
position ``p`` of a request lives in the same block and slot in both caches. Each step it

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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sonar.core.speculative import SpeculativeConfig
from sonar.kernels.attention import AttentionMetadata, allocate_kv_caches
from sonar.log import get_logger
from sonar.models.errors import ModelLoadError
from sonar.models.loader import LoadedModel, load_model

log = get_logger("sonar.drafter")


@dataclass(frozen=True, slots=True)
class DraftStart:
    """Where a request's drafts start: its last kept token, that token's position, its blocks."""

    token: int
    position: int
    block_ids: list[int]


class Drafter:
    def __init__(
        self,
        spec: SpeculativeConfig,
        *,
        dtype: str,
        device: torch.device,
        vocab_size: int,
        block_size: int,
    ) -> None:
        if spec.model is None:
            raise ModelLoadError("speculative method draft_model needs a model (--spec-model)")
        self.k = spec.num_speculative_tokens
        self.block_size = block_size
        self.device = device
        self.loaded: LoadedModel = load_model(
            spec.model, dtype=dtype, revision=spec.revision, device=device, quantization=spec.quantization
        )
        self.model = self.loaded.model
        draft_vocab = int(self.loaded.config.vocab_size)
        if draft_vocab != vocab_size:
            raise ModelLoadError(
                f"the draft model {spec.model!r} has a vocabulary of {draft_vocab} tokens, the target {vocab_size}: "
                "a draft model must share the target's tokenizer"
            )
        self.vocab_size = vocab_size
        self.kv_caches: list[torch.Tensor] = []
        log.info(
            "drafter.loaded",
            model=self.loaded.source,
            architecture=self.loaded.architecture,
            dtype=str(self.loaded.dtype).removeprefix("torch."),
            seconds=round(self.loaded.load_seconds, 2),
        )

    def kv_bytes_per_block(self, dtype: torch.dtype) -> int:
        model = self.model
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * model.num_layers * self.block_size * model.num_kv_heads * model.head_dim * element

    def allocate(self, num_blocks: int, dtype: torch.dtype, max_model_len: int) -> None:
        """Its KV cache: `num_blocks` blocks, as many as the target's, of `dtype` (what
        ``--kv-cache-dtype`` makes of the draft's own dtype). The draft must reach the target's
        `max_model_len`."""
        if self.loaded.max_model_len < max_model_len:
            raise ModelLoadError(
                f"the draft model {self.loaded.source!r} reaches {self.loaded.max_model_len} positions, fewer "
                f"than the target's max_model_len {max_model_len}; lower --max-model-len"
            )
        model = self.model
        self.kv_caches = allocate_kv_caches(
            model.num_layers, num_blocks, self.block_size, model.num_kv_heads, model.head_dim, dtype, self.device
        )

    @torch.inference_mode()
    def observe(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """Compute the step's tokens, for their KV (the hidden states are dropped)."""
        self.model(ids, positions, self.kv_caches, meta)

    @torch.inference_mode()
    def propose(self, starts: list[DraftStart]) -> list[list[int]]:
        """Up to ``k`` drafts after each start, as far as its block table has room (one fewer
        slot than drafts: the last draft's KV is written by the step that verifies it)."""
        drafts: list[list[int]] = [[] for _ in starts]
        room = [min(self.k, len(s.block_ids) * self.block_size - s.position) for s in starts]
        tokens = [s.token for s in starts]
        live = [i for i, r in enumerate(room) if r > 0]
        for step in range(self.k):
            live = [i for i in live if room[i] > step]
            if not live:
                break
            positions = [starts[i].position + step for i in live]
            meta = AttentionMetadata.build(
                [1] * len(live),
                [p + 1 for p in positions],
                [starts[i].block_ids for i in live],
                self.block_size,
                device=self.device,
            )
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
