"""A test-only greedy engine: steps a batch of prompts through a Sonar model over a paged KV cache.

Blocks come from a shuffled pool (so no sequence's blocks are contiguous), the cache starts
filled with NaN (so reading a slot nobody wrote shows up in the output), and sequences may
join at different steps and prefill in chunks, so one step can mix prefills, chunks over a
cached prefix and decodes, as the engine's scheduler will.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sonar.kernels.attention import AttentionMetadata, allocate_kv_caches
from sonar.models.decoder import DecoderForCausalLM


@dataclass
class _Seq:
    prompt: list[int]
    join_step: int
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    output: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    prompt_logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass
class Generation:
    tokens: list[list[int]]
    logits: list[torch.Tensor]  # per sequence [max_new_tokens, vocab], the logits each token was picked from
    prompt_logits: list[torch.Tensor]  # per sequence [len(prompt), vocab]
    steps: int


class GreedyDriver:
    def __init__(
        self,
        model: DecoderForCausalLM,
        dtype: torch.dtype,
        num_blocks: int = 256,
        block_size: int = 16,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.kv_caches = allocate_kv_caches(
            model.num_layers, num_blocks, block_size, model.num_kv_heads, model.head_dim, dtype
        )
        for cache in self.kv_caches:
            cache.fill_(float("nan"))
        gen = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=gen).tolist()

    def _grow(self, seq: _Seq, length: int) -> None:
        while len(seq.blocks) * self.block_size < length:
            seq.blocks.append(self.free.pop())

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        prefill_chunk: int | None = None,
        join_steps: list[int] | None = None,
        prompt_logits: bool = False,
    ) -> Generation:
        seqs = [_Seq(list(p), (join_steps or [0] * len(prompts))[i]) for i, p in enumerate(prompts)]
        step = 0
        while any(len(s.output) < max_new_tokens for s in seqs):
            active = [s for s in seqs if s.join_step <= step and len(s.output) < max_new_tokens]
            ids, positions, q_lens, s_lens, tables, picks, prompt_rows = [], [], [], [], [], [], []
            for s in active:
                remaining = len(s.prompt) - s.computed
                n = min(remaining, prefill_chunk or remaining) if remaining > 0 else 1
                start = s.computed
                tokens = s.tokens[start : start + n]
                self._grow(s, start + n)
                if remaining > 0 and prompt_logits:
                    prompt_rows.append((s, len(ids), n))
                ids += tokens
                positions += range(start, start + n)
                q_lens.append(n)
                s_lens.append(start + n)
                tables.append(s.blocks)
                s.computed = start + n
                if s.computed >= len(s.prompt):
                    picks.append((s, len(ids) - 1))
            meta = AttentionMetadata.build(q_lens, s_lens, tables, self.block_size)
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.kv_caches, meta)
            if picks:
                logits = self.model.compute_logits(hidden[torch.tensor([row for _, row in picks])])
                for (s, _), row in zip(picks, logits):
                    s.logits.append(row)
                    s.output.append(int(row.argmax()))
            for s, first, n in prompt_rows:
                s.prompt_logits.append(self.model.compute_logits(hidden[first : first + n]))
            step += 1
        return Generation(
            tokens=[s.output for s in seqs],
            logits=[torch.stack(s.logits) for s in seqs],
            prompt_logits=[torch.cat(s.prompt_logits) if s.prompt_logits else torch.empty(0) for s in seqs],
            steps=step,
        )
