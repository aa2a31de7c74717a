"""The target's vocabulary as a speculative head reads it: its token embeddings and its LM head.

A head (EAGLE, EAGLE-3, DeepSeek's MTP layer) runs on one rank, the sampler. Without tensor
parallelism it reads the target's own modules (`TargetVocab`). With it, each rank of the group holds
a slice of the vocabulary rows of both, and a lookup or a logits row is a collective every rank of
the group must join; the other ranks do not run the head, so they cannot. The group gathers both
whole once, at load time (`gather_vocab`), and the sampler keeps the copies (`WholeVocab`): one
more embedding matrix and LM head in that rank's memory. A pipeline stage needs no copy: every
stage holds the whole embedding and LM head of a target without tensor parallelism.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor
from torch.nn import functional as F

__all__ = ["HeadVocab", "TargetVocab", "WholeVocab", "gather_vocab"]


class HeadVocab(Protocol):
    def embed_tokens(self, ids: Tensor) -> Tensor:
        """The target's embedding rows of `ids` ``[n, hidden]``."""
        ...

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """The target's LM head over `hidden`: float32 logits ``[n, >= vocab_size]``."""
        ...


class TargetVocab:
    """The target's own embedding and LM head (one rank holds them whole)."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def embed_tokens(self, ids: Tensor) -> Tensor:
        return self.target.model.embed_tokens(ids)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.target.compute_logits(hidden)


class WholeVocab:
    """Copies of the whole embedding matrix and LM head weight ``[vocab, hidden]`` each."""

    def __init__(self, embeddings: Tensor, lm_head: Tensor) -> None:
        self.embeddings = embeddings
        self.lm_head = lm_head

    def embed_tokens(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.embeddings)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return F.linear(hidden, self.lm_head).float()


@torch.inference_mode()
def gather_vocab(target: Any) -> WholeVocab:
    """The whole vocabulary of a target split over a tensor-parallel group: a collective, every
    rank of the group calls it. Both go through the target's own modules (a vocabulary-parallel
    lookup of every id; the LM head over the identity matrix, gathered as logits are), so a
    quantized or prepacked LM head gives its weights as its logits see them."""
    vocab, hidden = target.vocab_size, target.config.hidden_size
    device = next(target.parameters()).device
    embeddings = target.model.embed_tokens(torch.arange(vocab, device=device))
    eye = torch.eye(hidden, dtype=embeddings.dtype, device=device)
    lm_head = target.compute_logits(eye)[:, :vocab].t().to(embeddings.dtype).contiguous()
    return WholeVocab(embeddings.clone(), lm_head)
