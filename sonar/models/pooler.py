"""Pooling models: which checkpoints are served as one (`pooling_info`), and how a request's hidden
states become its result (`Pooler`).

A model is served for pooling when ``--runner pooling`` or ``--convert embed|classify|reward``
asks, or (``--runner auto``) when it can do nothing else: an encoder (BERT, XLM-R), a
``*ForSequenceClassification`` or a ``*ForTokenClassification`` checkpoint. How it pools comes
from, in order, ``--pooler-config``, a sentence-transformers folder (``modules.json``,
``1_Pooling/config.json``: the pooling mode and whether a ``Normalize`` module follows) and the
model's kind (an encoder pools its first (CLS) token, a decoder its last, a token classifier and a
reward model none: one row per token).

``--convert reward`` is vLLM's (the reference's choices lack it): per-token rewards, pooling ALL,
neither normalized nor activated by default, as vLLM's reward pooler. A model with a per-token
head (a decoder ``*ForSequenceClassification``, whose ``score`` transformers also applies to every
token before taking the last one's, or a token classifier) gives its head's logits per token; one
without a head gives its hidden states per token.
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
    "sentence_transformers_lower_case",
    "sentence_transformers_max_len",
    "sentence_transformers_pooling",
    "wants_pooling",
]

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify", "reward")
POOLING_CONVERTS = ("embed", "classify", "reward")
"""The ``--convert`` values that make any model a pooling model."""

# sentence-transformers' pooling modes that Sonar's pooling types are
_ST_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_ST_MODULES = {
    "sentence_transformers.models.Transformer",
    "sentence_transformers.models.Pooling",
    "sentence_transformers.models.Normalize",
}


def natively_pooling(model_cls: type) -> bool:
    """Whether a model class can only pool: an encoder, or one with a classification head (of
    sequences or of tokens)."""
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
        if convert in POOLING_CONVERTS:
            raise ModelLoadError(f"--convert {convert} makes a pooling model: it cannot run with --runner generate")
        return False
    return runner == "pooling" or native or convert in POOLING_CONVERTS


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


def _sentence_bert_config(model_dir: Path) -> dict[str, Any]:
    """A sentence-transformers folder's ``sentence_bert_config.json`` ({} without one)."""
    config_file = model_dir / "sentence_bert_config.json"
    if not config_file.is_file():
        return {}
    try:
        config = json.loads(config_file.read_text())
    except ValueError as exc:
        raise ModelLoadError(f"{config_file}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{config_file}: not a JSON object")
    return config


def sentence_transformers_max_len(model_dir: Path) -> int | None:
    """``max_seq_length`` of a sentence-transformers folder (``sentence_bert_config.json``): the
    length it cuts inputs to, often less than the model's positions (all-MiniLM-L6-v2: 256 of 512),
    so the model's default context; None without one."""
    value = _sentence_bert_config(model_dir).get("max_seq_length")
    return int(value) if isinstance(value, int) and value > 0 else None


def sentence_transformers_lower_case(model_dir: Path) -> bool:
    """``do_lower_case`` of a sentence-transformers folder (``modules.json`` beside
    ``sentence_bert_config.json``): `SentenceTransformer` lowercases text before its tokenizer sees
    it (whatever the tokenizer itself does), so Sonar must too."""
    if not (model_dir / "modules.json").is_file():
        return False
    value = _sentence_bert_config(model_dir).get("do_lower_case", False)
    if not isinstance(value, bool):
        raise ModelLoadError(f"{model_dir / 'sentence_bert_config.json'}: do_lower_case must be true or false")
    return value


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
    name = type(model).__name__
    head = int(getattr(model, "num_labels", 0) or 0) if hasattr(model, "classify") else 0
    per_token = bool(getattr(model, "per_token", False))
    causal = bool(getattr(model, "is_causal", True))
    if convert in POOLING_CONVERTS:
        kind = convert
    else:
        kind = "token_classify" if per_token else ("classify" if head else "embed")
    if kind == "classify" and per_token:
        raise ModelLoadError(
            f"--convert classify: {name} classifies each token, not a whole sequence; serve it as it is "
            "(the token_classify task) or with --convert reward"
        )
    if kind == "classify" and not head:
        raise ModelLoadError(
            f"--convert classify needs a classification head, which {name} lacks: serve a "
            "*ForSequenceClassification checkpoint, or give the head's tokens with --hf-overrides "
            '\'{"architectures": ["...ForSequenceClassification"], "classifier_from_token": [...]}\''
        )
    if kind == "reward" and head and not causal and not per_token:
        raise ModelLoadError(
            f"--convert reward: {name}'s head reads the first token only (through its pooler), so it gives "
            "no per-token rewards; serve it as a classifier, or its encoder with --convert embed"
        )
    if kind in ("reward", "token_classify"):
        what = "--convert reward" if kind == "reward" else f"{name} (a token classifier)"
        if pooler.pooling_type not in (None, "all"):
            raise ModelLoadError(
                f"--pooler-config pooling_type {pooler.pooling_type.upper()}: {what} gives one row per token "
                "(pooling type ALL)"
            )
        if pooler.dimensions is not None:
            raise ModelLoadError(f"--pooler-config dimensions applies to embeddings, not to {what}")
        rows = "token_classify" if head else "token_embed"  # what its rows are
        if rows == "token_classify" and pooler.normalize is not None:
            raise ModelLoadError(f"--pooler-config normalize applies to embeddings, not to {what}'s label logits")
        if rows == "token_embed" and pooler.use_activation is not None:
            raise ModelLoadError(
                f"--pooler-config use_activation applies to classifiers, not to {what}'s hidden states"
            )
    st_type, st_normalize = sentence_transformers_pooling(model_dir)
    default_type = getattr(model, "default_pooling_type", None) or ("last" if causal else "cls")
    pooling_type = "all" if kind in ("reward", "token_classify") else pooler.pooling_type or st_type or default_type
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
    tasks, why_not = _tasks(kind, pooling_type, head, name, causal)
    normalize = kind != "reward" and (st_normalize if st_normalize is not None else True)
    return PoolingInfo(
        tasks=tasks,
        pooling_type=pooling_type,
        hidden_size=hidden,
        causal=causal,
        normalize=pooler.normalize if pooler.normalize is not None else normalize,
        use_activation=kind != "reward" if pooler.use_activation is None else pooler.use_activation,
        dimensions=pooler.dimensions,
        num_labels=head,
        labels=labels,
        matryoshka=matryoshka,
        matryoshka_dimensions=matryoshka_dims,
        why_not=why_not,
        reward=kind == "reward",
        # SentenceTransformer lowercases; CrossEncoder ignores the setting (a classifier's folder keeps case)
        lower_case=kind == "embed" and sentence_transformers_lower_case(model_dir),
    )


def _tasks(kind: str, pooling_type: str, head: int, name: str, causal: bool) -> tuple[list[str], dict[str, str]]:
    """The tasks a model served as `kind` answers, and why not the others."""
    # a decoder's head applies to each token (transformers computes it for all); a cross-encoder's does not
    per_token_head = "; its head's logits per token: --convert reward" if causal else ""
    if kind == "reward":
        task = "token_classify" if head else "token_embed"
        rest = "it is served as a reward model (--convert reward): one reward per token, the " + task + " task"
        return [task], {t: rest for t in ("embed", "classify", "token_embed", "token_classify") if t != task}
    if kind == "token_classify":
        rest = (
            f"{name} is a token classifier: one label distribution per token, the token_classify task "
            "(POST /pooling); serve it with --convert embed for embeddings"
        )
        return ["token_classify"], {t: rest for t in ("embed", "classify", "token_embed")}
    no_token_classify = "per-token classification needs a *ForTokenClassification model"
    if kind == "embed" and pooling_type == "all":
        return ["token_embed"], {
            "embed": "its pooling type is ALL (--pooler-config): one vector per token, the token_embed task",
            "classify": "it is served as an embedding model; a classifier needs its head",
            "token_classify": no_token_classify,
        }
    if kind == "embed":
        return ["embed", "token_embed"], {
            "classify": "it is served as an embedding model (--convert embed); a classifier needs its head",
            "token_classify": no_token_classify,
        }
    if pooling_type == "all":
        raise ModelLoadError(
            f"--pooler-config pooling_type ALL gives one vector per token: not a classifier's input{per_token_head}"
        )
    not_embed = "it is served as a classifier; serve it with --convert embed for embeddings"
    return ["classify"], {
        "embed": not_embed,
        "token_embed": not_embed,
        "token_classify": f"{name} classifies whole sequences{per_token_head}",
    }


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
