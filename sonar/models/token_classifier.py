"""Token classifiers (``*ForTokenClassification``: named entities, per-token labels): a model's
last hidden state of every token through one linear head to that token's label logits.

The encoders' head is ``classifier`` on BERT's / RoBERTa's sequence output (no pooler, no tanh);
the decoders' is transformers' generic ``score`` (a bias unless ``token_classification_bias`` is
false) on the final-normed hidden states. Dropout, which transformers applies before the head in
training only, is left out. The runner keeps every row of such a request (pooling type ALL) and
`classify` turns them into logits together.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor, nn

from sonar.models.bert import BertModel, config_labels
from sonar.models.decoder import DecoderForCausalLM
from sonar.models.llama import LlamaForCausalLM, MistralForCausalLM
from sonar.models.parallel import SINGLE, WHOLE, PipelineStage, TensorParallel
from sonar.models.qwen2 import Qwen2ForCausalLM
from sonar.models.qwen3 import Qwen3ForCausalLM


class BertForTokenClassification(BertModel):
    """The encoder, then ``classifier`` on every token."""

    architectures = ("BertForTokenClassification",)
    per_token: ClassVar[bool] = True
    """`classify` applies to each token's row (the runner keeps them all); the default pooling type
    stays the encoder's, for ``--convert embed``."""

    def __init__(self, config: Any, parallel: TensorParallel = SINGLE, stage: PipelineStage = WHOLE) -> None:
        super().__init__(config, parallel, stage)
        self.id2label = config_labels(config)
        self.num_labels = len(self.id2label)
        self.classifier = nn.Linear(config.hidden_size, self.num_labels)

    def classify(self, rows: Tensor) -> Tensor:
        """Hidden states ``[n, hidden_size]`` to float32 logits ``[n, num_labels]``."""
        return self.classifier(rows).float()


class RobertaForTokenClassification(BertForTokenClassification):
    architectures = ("RobertaForTokenClassification",)
    roberta_positions = True


class XLMRobertaForTokenClassification(RobertaForTokenClassification):
    architectures = ("XLMRobertaForTokenClassification",)


class DecoderForTokenClassification(DecoderForCausalLM):
    """The runner's contract of `DecoderForCausalLM` for `forward`; `classify` instead of
    `compute_logits`: every token's hidden state to its float32 label logits."""

    per_token: ClassVar[bool] = True

    def __init__(self, config: Any, parallel: TensorParallel = SINGLE, stage: PipelineStage = WHOLE) -> None:
        super().__init__(config, parallel, stage)
        del self.lm_head
        self.tie_word_embeddings = False
        self.id2label = config_labels(config)
        self.num_labels = len(self.id2label)
        bias = bool(getattr(config, "token_classification_bias", True))
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=bias)

    def classify(self, rows: Tensor) -> Tensor:
        """Hidden states ``[n, hidden_size]`` to float32 logits ``[n, num_labels]``."""
        return self.score(rows).float()


class LlamaForTokenClassification(DecoderForTokenClassification, LlamaForCausalLM):
    architectures = ("LlamaForTokenClassification",)


class MistralForTokenClassification(DecoderForTokenClassification, MistralForCausalLM):
    architectures = ("MistralForTokenClassification",)


class Qwen2ForTokenClassification(DecoderForTokenClassification, Qwen2ForCausalLM):
    architectures = ("Qwen2ForTokenClassification",)


class Qwen3ForTokenClassification(DecoderForTokenClassification, Qwen3ForCausalLM):
    architectures = ("Qwen3ForTokenClassification",)
