"""BERT-style encoders (BERT, RoBERTa, XLM-RoBERTa) and their cross-encoder heads, for pooling.

An encoder step is a flat batch of whole sequences (`AttentionMetadata.query_start_loc` gives
each one's rows); every token attends to its whole sequence (`sonar.kernels.encoder_attention`)
and no KV cache is kept, so `forward` ignores the caches the runner passes. Layers are
post-LayerNorm with biases everywhere; the activation is the config's `hidden_act`.

RoBERTa and XLM-R differ from BERT in two places: position ids start at ``pad_token_id + 1``
(so a sequence may hold ``max_position_embeddings - pad_token_id - 1`` tokens), and their
classification head is dense + tanh + ``out_proj`` on the first token, where BERT's is its pooler
(dense + tanh) then ``classifier``.

Module and parameter names follow the Hugging Face checkpoints without their ``bert.`` /
``roberta.`` prefix (`BertModel.save_pretrained` writes none, the classifiers write it), except
that query/key/value are one ``qkv_proj``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sonar.kernels.attention import AttentionMetadata
from sonar.kernels.encoder_attention import encoder_attention, sequence_starts
from sonar.models.decoder import fused_name
from sonar.models.errors import ModelLoadError
from sonar.models.parallel import SINGLE, WHOLE, PipelineStage, TensorParallel

ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
PREFIXES = ("bert.", "roberta.")


def config_labels(config: Any) -> dict[int, str]:
    """A classifier's labels by index, from ``id2label`` (a cached config keeps that, with string
    keys, and not transformers' derived ``num_labels``)."""
    return {int(i): label for i, label in (getattr(config, "id2label", None) or {}).items()}


def embedding(rows: int, hidden: int) -> nn.Embedding:
    # the weight given: no random init, whose meta-device kernel would import torch._dynamo (seconds)
    return nn.Embedding(rows, hidden, _weight=torch.empty(rows, hidden))


class Embeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.word_embeddings = embedding(config.vocab_size, hidden)
        self.position_embeddings = embedding(config.max_position_embeddings, hidden)
        self.token_type_embeddings = embedding(config.type_vocab_size, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)

    def forward(self, input_ids: Tensor, positions: Tensor, token_type_ids: Tensor | None) -> Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x)


class Output(nn.Module):
    """A projection added to the residual, then LayerNorm (post-norm)."""

    def __init__(self, inner: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(inner, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: Tensor, residual: Tensor) -> Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(hidden, 3 * hidden)
        self.output = Output(hidden, hidden, config.layer_norm_eps)

    def forward(self, x: Tensor, starts: list[int], starts_tensor: Tensor) -> Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        o = encoder_attention(q, k, v, starts, self.scale, starts_tensor)
        return self.output(o.reshape(n, -1), x)


class Intermediate(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        act = config.hidden_act
        if act not in ACTIVATIONS:
            raise ModelLoadError(f"hidden_act {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        self.act = ACTIVATIONS[act]
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.dense(x))


class Layer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.intermediate = Intermediate(config)
        self.output = Output(config.intermediate_size, config.hidden_size, config.layer_norm_eps)

    def forward(self, x: Tensor, starts: list[int], starts_tensor: Tensor) -> Tensor:
        x = self.attention(x, starts, starts_tensor)
        return self.output(self.intermediate(x), x)


class Encoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Layer(config) for _ in range(config.num_hidden_layers))


class BertModel(nn.Module):
    """The encoder alone (embedding models).

    The runner's contract: `forward` over a flat batch of whole sequences (positions from 0)
    returns the last hidden states; the classifiers (`num_labels` > 0, `id2label`) add
    `classify`, which turns pooled first-token states into float32 logits.
    """

    architectures: ClassVar[tuple[str, ...]] = ("BertModel",)
    is_causal: ClassVar[bool] = False
    tie_word_embeddings: ClassVar[bool] = False
    default_pooling_type: ClassVar[str] = "cls"
    roberta_positions: ClassVar[bool] = False
    """Position ids start at ``pad_token_id + 1`` (RoBERTa, XLM-R)."""

    def __init__(self, config: Any, parallel: TensorParallel = SINGLE, stage: PipelineStage = WHOLE) -> None:
        super().__init__()
        if parallel.size > 1 or stage.size > 1:
            raise ModelLoadError(
                f"{type(self).__name__}: encoder models run on one device (no tensor or pipeline parallelism)"
            )
        kind = getattr(config, "position_embedding_type", None) or "absolute"
        if kind != "absolute":
            raise ModelLoadError(f"position_embedding_type {kind!r} is not supported (only absolute)")
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.vocab_size = config.vocab_size
        self.position_offset = config.pad_token_id + 1 if self.roberta_positions else 0
        self.max_positions = config.max_position_embeddings - self.position_offset
        """How many tokens a sequence may hold."""
        self.id2label: dict[int, str] = {}
        self.num_labels = 0
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: Any,
        attn_metadata: AttentionMetadata,
        token_type_ids: Tensor | None = None,
    ) -> Tensor:
        """The last hidden states ``[num_tokens, hidden_size]``; `token_type_ids` None: all 0."""
        starts = sequence_starts(attn_metadata)
        x = self.embeddings(input_ids, positions + self.position_offset, token_type_ids)
        for layer in self.encoder.layer:
            x = layer(x, starts, attn_metadata.query_start_loc)
        return x

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Copy checkpoint tensors into the parameters, casting to their dtype; returns the names
        of the parameters completely written. Tensors without a place (a pooler the model does
        not use, ``position_ids`` buffers, an MLM head) are skipped."""
        params = dict(self.named_parameters())
        hidden = self.config.hidden_size
        stacked = {
            ".attention.self.query.": (".attention.qkv_proj.", 0, hidden),
            ".attention.self.key.": (".attention.qkv_proj.", hidden, hidden),
            ".attention.self.value.": (".attention.qkv_proj.", 2 * hidden, hidden),
        }
        written: set[tuple[str, int]] = set()
        for name, tensor in weights:
            for prefix in PREFIXES:
                name = name.removeprefix(prefix)
            target_name, first, rows = fused_name(name, stacked)
            target = params.get(target_name)
            if target is None:
                continue
            dest = target.data if rows is None else target.data.narrow(0, first, rows)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    f"weight {name} has shape {tuple(tensor.shape)}, the model expects {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            written.add((target_name, first))
        offsets = (0, hidden, 2 * hidden)
        return {
            name for name in params if all((name, o) in written for o in (offsets if ".qkv_proj." in name else (0,)))
        }


class RobertaModel(BertModel):
    architectures = ("RobertaModel",)
    roberta_positions = True


class XLMRobertaModel(BertModel):
    architectures = ("XLMRobertaModel",)
    roberta_positions = True


class Pooler(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.dense(x))


class BertForSequenceClassification(BertModel):
    """A BERT cross-encoder: the pooler (dense + tanh on the first token) then ``classifier``."""

    architectures = ("BertForSequenceClassification",)

    def __init__(self, config: Any, parallel: TensorParallel = SINGLE, stage: PipelineStage = WHOLE) -> None:
        super().__init__(config, parallel, stage)
        self.id2label = config_labels(config)
        self.num_labels = len(self.id2label)
        self.pooler = Pooler(config.hidden_size)
        self.classifier = nn.Linear(config.hidden_size, self.num_labels)

    def classify(self, pooled: Tensor) -> Tensor:
        """First-token hidden states ``[n, hidden_size]`` to float32 logits ``[n, num_labels]``."""
        return self.classifier(self.pooler(pooled)).float()


class RobertaClassificationHead(nn.Module):
    def __init__(self, hidden: int, labels: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, labels)

    def forward(self, x: Tensor) -> Tensor:
        return self.out_proj(torch.tanh(self.dense(x)))


class RobertaForSequenceClassification(RobertaModel):
    """A RoBERTa cross-encoder: dense + tanh + ``out_proj`` on the first token."""

    architectures = ("RobertaForSequenceClassification",)

    def __init__(self, config: Any, parallel: TensorParallel = SINGLE, stage: PipelineStage = WHOLE) -> None:
        super().__init__(config, parallel, stage)
        self.id2label = config_labels(config)
        self.num_labels = len(self.id2label)
        self.classifier = RobertaClassificationHead(config.hidden_size, self.num_labels)

    def classify(self, pooled: Tensor) -> Tensor:
        """First-token hidden states ``[n, hidden_size]`` to float32 logits ``[n, num_labels]``."""
        return self.classifier(pooled).float()


class XLMRobertaForSequenceClassification(RobertaForSequenceClassification):
    architectures = ("XLMRobertaForSequenceClassification",)
