"""Pooling models: which checkpoints are served as one (`pooling_info`), and how a request's hidden
states become its result (`Pooler`).

A model is served for pooling when ``--runner pooling`` or ``--convert embed|classify`` asks, or
(``--runner auto``) when it can do nothing else: an encoder (BERT, XLM-R) or a
``*ForSequenceClassification`` checkpoint. How it pools comes from, in order, ``--pooler-config``,
a sentence-transformers folder (``modules.json``, ``1_Pooling/config.json``: the pooling mode and
whether a ``Normalize`` module follows) and the model's kind (an encoder pools its first (CLS)
token, a decoder its last).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from sonar.models.errors import ModelLoadError
from sonar.pooling_params import PooledData, PoolerConfig, PoolingInfo, PoolingParams

__all__ = [
    "PoolState",
    "Pooler",
    "pooling_info",
    "sentence_transformers_max_len",
    "sentence_transformers_pooling",
    "wants_pooling",
]

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")

# sentence-transformers' pooling modes that Sonar's pooling types are
_ST_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_ST_MODULES = {
    "sentence_transformers.models.Transformer",
    "sentence_transformers.models.Pooling",
    "sentence_transformers.models.Normalize",
}


def natively_pooling(model_cls: type) -> bool:
    """Whether a model class can only pool: an encoder, or one with a classification head."""
    return not getattr(model_cls, "is_causal", True) or hasattr(model_cls, "classify")


def wants_pooling(model_cls: type, runner: str, convert: str) -> bool:
    """Whether ``--runner`` / ``--convert`` make the model a pooling model; raises
    `ModelLoadError` for a combination that cannot be served."""
    if runner not in RUNNERS:
        hint = " (a draft model is given with --speculative-config)" if runner == "draft" else ""
        raise ModelLoadError(f"--runner {runner} is not supported; choose one of {', '.join(RUNNERS)}{hint}")
    if convert not in CONVERTS:
        raise ModelLoadError(f"--convert {convert} is not supported; choose one of {', '.join(CONVERTS)}")
    native = natively_pooling(model_cls)
    if runner == "generate":
        if native:
            raise ModelLoadError(
                f"{model_cls.__name__} is a pooling model (embeddings, scores): it cannot run with --runner generate"
            )
        if convert in ("embed", "classify"):
            raise ModelLoadError(f"--convert {convert} makes a pooling model: it cannot run with --runner generate")
        return False
    return runner == "pooling" or native or convert in ("embed", "classify")


def sentence_transformers_pooling(model_dir: Path) -> tuple[str | None, bool | None]:
    """(pooling type, normalize) from a sentence-transformers folder, (None, None) without one;
    raises `ModelLoadError` for modules Sonar cannot reproduce (a Dense projection, max pooling),
    which served without them would give other vectors than the model's."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return None, None
    try:
        modules = json.loads(modules_file.read_text())
    except ValueError as exc:
        raise ModelLoadError(f"{modules_file}: not valid JSON ({exc})") from None
    pooling_type: str | None = None
    normalize = False
    for module in modules:
        kind = module.get("type", "")
        if kind not in _ST_MODULES:
            raise ModelLoadError(
                f"{modules_file}: the sentence-transformers module {kind or module!r} is not supported "
                "(Sonar serves Transformer, Pooling and Normalize)"
            )
        if kind.endswith(".Normalize"):
            normalize = True
        if kind.endswith(".Pooling"):
            pooling_type = _st_pooling_type(model_dir / module.get("path", ""))
    return pooling_type, normalize


def sentence_transformers_max_len(model_dir: Path) -> int | None:
    """``max_seq_length`` of a sentence-transformers folder (``sentence_bert_config.json``): the
    length it cuts inputs to, often less than the model's positions (all-MiniLM-L6-v2: 256 of 512),
    so the model's default context; None without one."""
    config_file = model_dir / "sentence_bert_config.json"
    if not config_file.is_file():
        return None
    try:
        value = json.loads(config_file.read_text()).get("max_seq_length")
    except ValueError as exc:
        raise ModelLoadError(f"{config_file}: not valid JSON ({exc})") from None
    return int(value) if isinstance(value, int) and value > 0 else None


def _st_pooling_type(folder: Path) -> str | None:
    config_file = folder / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    if config.get("include_prompt") is False:
        raise ModelLoadError(f"{config_file}: include_prompt false (instruction tokens left out) is not supported")
    for key in _ST_UNSUPPORTED:
        if config.get(key):
            raise ModelLoadError(f"{config_file}: {key} is not supported (Sonar pools cls, mean or last)")
    chosen = [kind for key, kind in _ST_MODES.items() if config.get(key)]
    if len(chosen) > 1:
        raise ModelLoadError(f"{config_file}: several pooling modes at once ({', '.join(chosen)}) are not supported")
    return chosen[0] if chosen else None


def pooling_info(model: Any, hf_config: Any, model_dir: Path, convert: str, pooler: PoolerConfig) -> PoolingInfo:
    """What the loaded `model` serves as a pooling model under ``--convert`` and ``--pooler-config``."""
    head = int(getattr(model, "num_labels", 0) or 0) if hasattr(model, "classify") else 0
    causal = bool(getattr(model, "is_causal", True))
    kind = convert if convert in ("embed", "classify") else ("classify" if head else "embed")
    if kind == "classify" and not head:
        raise ModelLoadError(
            f"--convert classify needs a classification head, which {type(model).__name__} lacks: serve a "
            "*ForSequenceClassification checkpoint, or give the head's tokens with --hf-overrides "
            '\'{"architectures": ["...ForSequenceClassification"], "classifier_from_token": [...]}\''
        )
    st_type, st_normalize = sentence_transformers_pooling(model_dir)
    default_type = getattr(model, "default_pooling_type", None) or ("last" if causal else "cls")
    pooling_type = pooler.pooling_type or st_type or default_type
    hidden = int(hf_config.hidden_size)
    matryoshka_dims = [int(d) for d in getattr(hf_config, "matryoshka_dimensions", None) or []]
    matryoshka = bool(getattr(hf_config, "is_matryoshka", False) or matryoshka_dims)
    if pooler.dimensions is not None and pooler.dimensions != hidden:
        if not matryoshka or pooler.dimensions > hidden:
            raise ModelLoadError(
                f"--pooler-config dimensions {pooler.dimensions}: the model's embeddings have {hidden} "
                "and it is not a Matryoshka model"
            )
    labels: list[str] = []
    if head:
        id2label = getattr(model, "id2label", None) or {}
        labels = [str(id2label.get(i, f"LABEL_{i}")) for i in range(head)]
    if kind == "embed" and pooling_type == "all":
        tasks = ["token_embed"]
        why_not = {
            "embed": "its pooling type is ALL (--pooler-config): one vector per token, the token_embed task",
            "classify": "it is served as an embedding model; a classifier needs its head",
        }
    elif kind == "embed":
        tasks = ["embed", "token_embed"]
        why_not = {
            "classify": "it is served as an embedding model (--convert embed); a classifier needs its head",
        }
    elif pooling_type == "all":
        raise ModelLoadError("--pooler-config pooling_type ALL gives one vector per token: not a classifier's input")
    else:
        tasks = ["classify"]
        why_not = {"embed": "it is served as a classifier; serve it with --convert embed for embeddings"}
    why_not["token_classify"] = "per-token classification models (*ForTokenClassification) are not served yet"
    if kind == "classify":
        why_not["token_embed"] = why_not["embed"]
    return PoolingInfo(
        tasks=tasks,
        pooling_type=pooling_type,
        hidden_size=hidden,
        causal=causal,
        normalize=pooler.normalize
        if pooler.normalize is not None
        else (st_normalize if st_normalize is not None else True),
        use_activation=True if pooler.use_activation is None else pooler.use_activation,
        dimensions=pooler.dimensions,
        num_labels=head,
        labels=labels,
        matryoshka=matryoshka,
        matryoshka_dimensions=matryoshka_dims,
        why_not=why_not,
    )


@dataclass
class PoolState:
    """What one request has kept of its hidden states so far (its prompt may take several
    steps): the first row, their float32 sum, or all of them, as its pooling needs."""

    keep: str
    """``cls``, ``mean``, ``all`` or ``last`` (nothing kept: the last row comes with the last step)."""
    first: Tensor | None = None
    total: Tensor | None = None
    count: int = 0
    rows: list[Tensor] | None = None

    def add(self, hidden: Tensor, start: int) -> None:
        """The rows of positions ``start ..`` computed by a step."""
        if self.keep == "cls" and start == 0:
            self.first = hidden[0].clone()
        elif self.keep == "mean":
            part = hidden.float().sum(0)
            self.total = part if self.total is None else self.total + part
            self.count += hidden.shape[0]
        elif self.keep == "all":
            self.rows = [*(self.rows or []), hidden.clone()]


class Pooler:
    """Turns hidden states into a request's result, as `PoolingInfo` and the request's
    `PoolingParams` say."""

    def __init__(self, info: PoolingInfo, model: Any) -> None:
        self.info = info
        self.model = model

    def state(self, params: PoolingParams) -> PoolState:
        return PoolState("all" if params.task.startswith("token_") else self.info.pooling_type)

    def finish(self, state: PoolState, last: Tensor, params: PoolingParams) -> PooledData:
        """The result, once the step with the prompt's last row (`last`, ``[hidden]``) has run."""
        info = self.info
        if state.keep == "all":
            assert state.rows is not None
            values = torch.cat(state.rows).float()
        elif state.keep == "mean":
            assert state.total is not None
            values = state.total / state.count
        elif state.keep == "cls":
            if state.first is None:
                raise RuntimeError("CLS pooling without the prompt's first row (computed from the prefix cache?)")
            values = state.first.float()
        else:
            values = last.float()
        if params.task in ("classify", "token_classify"):
            logits = self.model.classify(values.to(last.dtype).reshape(-1, values.shape[-1])).float()
            if params.use_activation if params.use_activation is not None else info.use_activation:
                logits = torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)
            values = logits if params.task == "token_classify" else logits[0]
        else:
            dims = params.dimensions or info.dimensions
            if dims is not None:
                values = values[..., :dims]
            if params.normalize if params.normalize is not None else info.normalize:
                values = F.normalize(values, p=2, dim=-1)
        values = values.contiguous().cpu()
        return PooledData(values.numpy().astype("<f4").tobytes(), list(values.shape))
