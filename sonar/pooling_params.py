"""What a pooling request asks for (`PoolingParams`), how a pooling model pools (`PoolerConfig`,
``--pooler-config``), what a pooling worker serves (`PoolingInfo`) and what it answers
(`PooledData`).

A pooling model runs a prompt through and returns a vector (or one per token) instead of sampling
tokens. Its *task* says which:

- ``embed``: the prompt's hidden states pooled into one vector (last token, mean, or the first
  (CLS) token), optionally cut to its first ``dimensions`` (Matryoshka models) and L2-normalized.
- ``classify``: the pooled vector through the model's classification head; with the activation,
  probabilities (softmax over the labels, or a sigmoid where the model has one label: a
  cross-encoder's relevance score).
- ``token_embed`` / ``token_classify``: the same per prompt token, unpooled: a token classifier's
  label probabilities for each token, or a reward model's (``--convert reward``) raw per-token
  rewards (its head's logits, or the hidden states of a model without one).

Torch-free: the frontend checks requests with it before the worker is up.
"""

from __future__ import annotations

from typing import Any

import msgspec

from sonar.errors import SonarError

__all__ = [
    "POOLING_TYPES",
    "TASKS",
    "PooledData",
    "PoolerConfig",
    "PoolingInfo",
    "PoolingParams",
    "PoolingParamsError",
]

TASKS = ("embed", "classify", "token_embed", "token_classify")
"""What a pooling request may ask for."""

POOLING_TYPES = ("last", "mean", "cls", "all")
"""How a sequence's hidden states become one vector: its last token's (decoder embedders such as
Qwen3-Embedding and e5-mistral), their mean, its first token's (BERT's CLS), or none (every
token's, for the token tasks)."""


class PoolingParamsError(SonarError, ValueError):
    """A pooling request or ``--pooler-config`` that cannot be served; `param` names the field."""

    status = 400

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PoolingParams(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """One pooling request's wishes; None leaves a choice to the model's `PoolerConfig`."""

    task: str = "embed"
    dimensions: int | None = None
    """``embed``: keep the first this many dimensions (a Matryoshka model's), before normalizing."""
    normalize: bool | None = None
    """``embed`` / ``token_embed``: L2-normalize the vector(s)."""
    use_activation: bool | None = None
    """``classify`` / ``token_classify``: softmax over the labels (sigmoid for a single label)."""
    pair_start: int | None = None
    """A text pair (a cross-encoder's query and document): the position of the second text's first
    token. Models with token type embeddings (BERT) embed it and what follows as type 1."""

    def check(self, info: PoolingInfo) -> None:
        """Raise `PoolingParamsError` naming the field the model cannot serve."""
        if self.task not in TASKS:
            raise PoolingParamsError(f"unknown pooling task {self.task!r}; choose one of {', '.join(TASKS)}", "task")
        if self.task not in info.tasks:
            raise PoolingParamsError(
                f"this model does not serve the {self.task!r} task (it serves {', '.join(info.tasks) or 'none'}); "
                f"{info.why_not.get(self.task, '')}".rstrip("; "),
                "task",
            )
        if self.dimensions is not None:
            if self.task != "embed":
                raise PoolingParamsError("dimensions applies to embeddings only", "dimensions")
            if isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) or self.dimensions < 1:
                raise PoolingParamsError(
                    f"dimensions must be a positive integer, got {self.dimensions!r}", "dimensions"
                )
            if self.dimensions != info.hidden_size and not info.matryoshka:
                raise PoolingParamsError(
                    f"this model does not support matryoshka representation: dimensions must be left out "
                    f"or equal to its embedding size {info.hidden_size}, got {self.dimensions}",
                    "dimensions",
                )
            if self.dimensions > info.hidden_size:
                raise PoolingParamsError(
                    f"dimensions {self.dimensions} is larger than the model's embedding size {info.hidden_size}",
                    "dimensions",
                )
            if info.matryoshka_dimensions and self.dimensions not in info.matryoshka_dimensions:
                shown = ", ".join(map(str, info.matryoshka_dimensions))
                raise PoolingParamsError(
                    f"dimensions {self.dimensions} is not one this model was trained for ({shown})", "dimensions"
                )
        if self.normalize is not None and self.task not in ("embed", "token_embed"):
            raise PoolingParamsError("normalize applies to embeddings only", "normalize")
        if self.use_activation is not None and self.task not in ("classify", "token_classify"):
            raise PoolingParamsError("use_activation applies to classification only", "use_activation")


class PoolerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``--pooler-config``: how the model pools, overriding what its checkpoint says (None: the
    checkpoint's choice, or the default for the model kind)."""

    pooling_type: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    """The default ``dimensions`` of ``embed`` requests that give none."""
    use_activation: bool | None = None

    @classmethod
    def parse(cls, raw: Any) -> PoolerConfig:
        """From the flag's JSON object (``activation`` and ``softmax`` are accepted for
        ``use_activation``; a pooling type in any case); `PoolingParamsError` names what is wrong."""
        if raw is None:
            return cls()
        if isinstance(raw, PoolerConfig):
            return raw
        if not isinstance(raw, dict):
            raise PoolingParamsError(f"--pooler-config must be a JSON object, got {raw!r}", "pooler_config")
        values = dict(raw)
        for alias in ("activation", "softmax"):
            if alias in values:
                if "use_activation" in values and values["use_activation"] != values[alias]:
                    raise PoolingParamsError(f"--pooler-config gives both {alias} and use_activation", "pooler_config")
                values["use_activation"] = values.pop(alias)
        if isinstance(values.get("pooling_type"), str):
            values["pooling_type"] = values["pooling_type"].lower()
        try:
            config = msgspec.convert(values, cls)
        except msgspec.ValidationError as exc:
            known = ", ".join(cls.__struct_fields__)
            raise PoolingParamsError(
                f"--pooler-config: {exc} (Sonar takes {known}, activation, softmax)", "pooler_config"
            ) from None
        if config.pooling_type is not None and config.pooling_type not in POOLING_TYPES:
            raise PoolingParamsError(
                f"--pooler-config: unknown pooling_type {config.pooling_type!r}; choose one of "
                f"{', '.join(t.upper() for t in POOLING_TYPES)}",
                "pooler_config",
            )
        if config.dimensions is not None and config.dimensions < 1:
            raise PoolingParamsError(
                f"--pooler-config: dimensions must be positive, got {config.dimensions}", "pooler_config"
            )
        return config


class PoolingInfo(msgspec.Struct, frozen=True):
    """What a pooling worker serves (`WorkerInfo.pooling`), settled when it loaded the model."""

    tasks: list[str]
    pooling_type: str
    hidden_size: int
    """The size of an embedding (the model's hidden size, or its projection's)."""
    causal: bool = True
    """False for encoder models (BERT, XLM-R): every token attends to every other, so a prompt is
    computed in one step and never partly from the prefix cache."""
    normalize: bool = True
    """Whether embeddings are L2-normalized unless a request says otherwise."""
    use_activation: bool = True
    dimensions: int | None = None
    """The default ``dimensions`` (``--pooler-config``)."""
    num_labels: int = 0
    labels: list[str] = []
    """The classification head's label names, by index (``id2label``)."""
    matryoshka: bool = False
    matryoshka_dimensions: list[int] = []
    """The dimensions a Matryoshka model was trained for (empty: any up to its size)."""
    why_not: dict[str, str] = {}
    """For a task it does not serve, why (the 400 says it)."""
    reward: bool = False
    """Served as a reward model (``--convert reward``): its token task gives per-token rewards,
    neither normalized nor activated unless ``--pooler-config`` or the request says so."""
    lower_case: bool = False
    """Text inputs are lowercased before tokenizing (``do_lower_case`` of a sentence-transformers
    folder's ``sentence_bert_config.json``, for an embedding model: sentence-transformers'
    CrossEncoder does not read it)."""


class PooledData(msgspec.Struct, frozen=True, array_like=True):
    """A pooling result as messages carry it: float32 values, little-endian, row-major."""

    data: bytes
    shape: list[int]

    def tolist(self) -> list[Any]:
        """The values as (nested) Python floats: a vector, or a list of rows."""
        import array

        values = array.array("f")
        values.frombytes(self.data)
        flat = values.tolist()
        if len(self.shape) == 1:
            return flat
        width = self.shape[-1]
        return [flat[i : i + width] for i in range(0, len(flat), width)]
