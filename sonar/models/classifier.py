"""Decoder sequence classifiers (``*ForSequenceClassification``): the causal decoder with a
``score`` projection ``[num_labels, hidden_size]`` (no bias) in place of the LM head, applied to
the hidden state of each sequence's last token.

A causal LM can be served as a classifier of some of its vocabulary's tokens (vLLM's
conversion, asked for with ``--hf-overrides``): a config with ``classifier_from_token`` takes
the ``score`` rows from the LM head rows of those tokens (the tokenizer gives their ids; the
loader sets `classifier_token_ids`). With ``is_original_qwen3_reranker`` and the two tokens
``["no", "yes"]``, the one row is ``yes - no``: sigmoid of that score is the softmax
probability of "yes" over the two, which is how Qwen3-Reranker scores a pair.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from sonar.models.bert import config_labels
from sonar.models.decoder import DecoderForCausalLM
from sonar.models.errors import ModelLoadError
from sonar.models.llama import LlamaForCausalLM, MistralForCausalLM
from sonar.models.parallel import SINGLE, WHOLE, PipelineStage, TensorParallel
from sonar.models.qwen2 import Qwen2ForCausalLM
from sonar.models.qwen3 import Qwen3ForCausalLM

LM_HEAD_ROWS = ("lm_head.weight", "model.embed_tokens.weight")


class DecoderForSequenceClassification(DecoderForCausalLM):
    """The runner's contract of `DecoderForCausalLM` for `forward`; `classify` instead of
    `compute_logits`: pooled hidden states (the last token's) to float32 logits."""

    default_pooling_type: ClassVar[str] = "last"

    def __init__(self, config: Any, parallel: TensorParallel = SINGLE, stage: PipelineStage = WHOLE) -> None:
        super().__init__(config, parallel, stage)
        del self.lm_head
        self.lm_head_tied = self.tie_word_embeddings
        """Whether the LM head of a converted causal LM is its embedding matrix."""
        self.tie_word_embeddings = False
        self.classifier_from_token = tuple(getattr(config, "classifier_from_token", None) or ())
        self.two_way = bool(getattr(config, "is_original_qwen3_reranker", False))
        if self.two_way and len(self.classifier_from_token) != 2:
            raise ModelLoadError(
                "is_original_qwen3_reranker needs classifier_from_token of two tokens (no, yes), "
                f"got {list(self.classifier_from_token)}"
            )
        self.classifier_token_ids: list[int] | None = None
        """The ids of `classifier_from_token`, which the loader reads from the tokenizer."""
        labels = config_labels(config)
        if self.two_way:
            self.num_labels = 1
        elif self.classifier_from_token:
            self.num_labels = len(self.classifier_from_token)
        else:
            self.num_labels = len(labels)
        # a converted causal LM's config keeps transformers' default two labels
        self.id2label = labels if len(labels) == self.num_labels else {i: f"LABEL_{i}" for i in range(self.num_labels)}
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)

    def classify(self, pooled: Tensor) -> Tensor:
        """Last-token hidden states ``[n, hidden_size]`` to float32 logits ``[n, num_labels]``."""
        return self.score(pooled).float()

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """`DecoderForCausalLM.load_weights`; a converted causal LM's ``score`` comes from its LM
        head rows (``lm_head.weight``, or with tied embeddings ``model.embed_tokens.weight``)."""
        if not self.classifier_from_token:
            return super().load_weights(weights)
        if self.classifier_token_ids is None:
            raise ModelLoadError("classifier_from_token needs the tokenizer's ids of its tokens")
        ids = torch.tensor(self.classifier_token_ids)
        rows: dict[str, Tensor] = {}

        def keep_rows(weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
            for name, tensor in weights:
                if name in LM_HEAD_ROWS:
                    rows[name] = tensor.index_select(0, ids).float()
                yield name, tensor

        done = super().load_weights(keep_rows(weights))
        head = rows.get("lm_head.weight")
        if head is None and self.lm_head_tied:
            head = rows.get("model.embed_tokens.weight")
        if head is None:
            raise ModelLoadError("classifier_from_token: the checkpoint has no lm_head.weight to take the rows from")
        self.score.weight.data.copy_(head[1:] - head[:1] if self.two_way else head)
        return done | {"score.weight"}


class LlamaForSequenceClassification(DecoderForSequenceClassification, LlamaForCausalLM):
    architectures = ("LlamaForSequenceClassification",)


class MistralForSequenceClassification(DecoderForSequenceClassification, MistralForCausalLM):
    architectures = ("MistralForSequenceClassification",)


class Qwen2ForSequenceClassification(DecoderForSequenceClassification, Qwen2ForCausalLM):
    architectures = ("Qwen2ForSequenceClassification",)


class Qwen3ForSequenceClassification(DecoderForSequenceClassification, Qwen3ForCausalLM):
    architectures = ("Qwen3ForSequenceClassification",)
