"""Model configs as transformers resolves them, cached so a warm start reads them without
importing transformers (its config modules alone take seconds to import).

`load_model` reads ``config.json`` through transformers' `AutoConfig` once; the attributes of
the config it returns (`to_dict`: defaults filled in, derived fields such as a Qwen2 window
resolved) are kept under ``$SONAR_CACHE_ROOT/configs/``, keyed by a hash of the exact
``config.json`` bytes and the installed transformers version. A later load of the same bytes
under the same version gets a `CachedConfig` with those attributes back, and with the values of
`READ` that the transformers class computes rather than stores (``rope_scaling`` aliases
``rope_parameters``, say); tests/models/test_config_cache.py checks them against transformers.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import threading
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import structlog

from sonar.paths import cache_root

log = structlog.get_logger(__name__)

TRANSFORMERS_LOCK = threading.RLock()
"""Held while transformers reads a config or a tokenizer in this process: it imports its modules
lazily, and two threads importing one at once can fail (``cannot import name 'AutoConfig'``: seen
when a worker read a new model's config while the server loaded its tokenizer)."""

CACHE_VERSION = 2
"""Part of every key: raised when `READ` grows, since older entries computed fewer attributes."""

READ = (
    "architectures", "attention_bias", "dtype", "eos_token_id", "head_dim", "hidden_act", "hidden_size",
    "initializer_range", "intermediate_size", "layer_types", "max_position_embeddings", "mlp_bias",
    "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "quantization_config", "rms_norm_eps",
    "rope_parameters", "rope_scaling", "rope_theta", "sliding_window", "tie_word_embeddings", "vocab_size",
    # mixture of experts (`sonar.models.moe`); Qwen3-MoE's num_experts aliases its stored num_local_experts
    "decoder_sparse_step", "mlp_only_layers", "moe_intermediate_size", "norm_topk_prob", "num_experts",
    "num_experts_per_tok", "num_local_experts", "qkv_bias", "shared_expert_intermediate_size",
)  # fmt: skip
"""What Sonar's model code reads from a config (``config.x``, ``getattr(config, "x")``; ``torch_dtype``,
read only when ``dtype`` is unset, is transformers' deprecated alias of it)."""


class CachedConfig(SimpleNamespace):
    """A transformers config's attributes read back from the cache."""

    def __init__(self, attributes: dict[str, Any], computed: dict[str, Any]) -> None:
        super().__init__(**computed, **attributes)
        self._attributes = attributes

    def to_dict(self) -> dict[str, Any]:
        """The transformers config's `to_dict` (its stored attributes)."""
        return copy.deepcopy(self._attributes)  # as JSON holds it: integer keys become strings


def _plain(value: Any) -> Any:
    """A computed value as JSON holds it: a torch dtype by its name (as `to_dict` writes one)."""
    return str(value).removeprefix("torch.") if type(value).__name__ == "dtype" else value


def cache_path(config_bytes: bytes) -> Path | None:
    """Where the resolved form of these ``config.json`` bytes lives (None without transformers)."""
    try:
        version = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None
    h = hashlib.sha256(config_bytes)
    h.update(f"\0transformers {version}\0v{CACHE_VERSION}".encode())
    return cache_root() / "configs" / f"{h.hexdigest()[:32]}.json"


def read(config_bytes: bytes) -> CachedConfig | None:
    """The cached config of these bytes, or None (not cached, or the file does not parse)."""
    path = cache_path(config_bytes)
    if path is None or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        log.warning("model.config_cache_unreadable", path=str(path), error=str(exc))
        return None
    try:
        return CachedConfig(data["attributes"], data["computed"])
    except (KeyError, TypeError):
        return None


def write(config_bytes: bytes, config: Any) -> None:
    """Keep `config` (a transformers config read from these bytes) for later loads."""
    path = cache_path(config_bytes)
    if path is None or hasattr(config, "text_config"):
        # a multimodal config's sub-configs would come back as plain dicts, without their
        # computed attributes: it is read through transformers every time
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        attributes = config.to_dict()
        computed = {n: _plain(getattr(config, n)) for n in READ if n not in attributes and hasattr(config, n)}
        tmp.write_text(json.dumps({"attributes": attributes, "computed": computed}))
        os.replace(tmp, path)
    except (OSError, TypeError, ValueError) as exc:  # not cached: the next load reads it again
        log.warning("model.config_cache_not_written", path=str(path), error=str(exc))
    finally:
        tmp.unlink(missing_ok=True)
