"""Where the benchmark finds the served model's tokenizer and config, locally only.

The client never downloads: a name is looked up as a local path, then in the local Hugging Face
cache, and otherwise Sonar's embedded SmolLM2-135M-Instruct is assumed (its tokenizer and
converted config live under Sonar's cache root).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

EMBEDDED_MATCH = "smollm2-135m"


@dataclass
class ModelFiles:
    """A local directory with the tokenizer (and perhaps config.json) of the benchmarked model."""

    tokenizer_dir: Path
    config_dir: Path | None
    note: str
    #: False when nothing matched and the embedded model was assumed.
    found: bool = True
    #: The embedded model's GGUF file, when these are its files.
    gguf: Path | None = None


def _hub_cache(name: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except Exception:
        return None


def _local_dir(name: str | None) -> Path | None:
    """`name` as a local model directory (or the directory of a local file), or from the HF cache."""
    if not name:
        return None
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        return path.parent
    if "/" in name and not name.startswith((".", "/")) and name.count("/") == 1:
        return _hub_cache(name)
    return None


def _embedded(found: bool) -> ModelFiles:
    from sonar.models import embedded
    from sonar.models.gguf_file import converted_dir

    tok = embedded.tokenizer_dir()
    conv = converted_dir(embedded.gguf_path())
    config = conv if (conv / "config.json").is_file() else None
    note = f"the embedded {embedded.EMBEDDED_NAME}" + ("" if found else " (assumed: no local tokenizer of that name)")
    return ModelFiles(tok, config, note, found, embedded.gguf_path())


def resolve_model_files(tokenizer: str | None, *names: str | None) -> ModelFiles:
    """The tokenizer (`tokenizer` if given, else the first of `names` found locally, else the
    embedded model's) and the config directory that goes with it. Without names the embedded
    model is meant, and also when a name mentions it (Sonar serves it as SmolLM2-135M-Instruct);
    otherwise it is only assumed (`found` False)."""
    if tokenizer:
        found = _local_dir(tokenizer)
        if found is None:
            raise ValueError(f"tokenizer {tokenizer!r} is neither a local path nor in the local Hugging Face cache")
        return ModelFiles(found, found if (found / "config.json").is_file() else None, str(found))
    for name in names:
        found = _local_dir(name)
        if found is not None and any((found / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            return ModelFiles(found, found if (found / "config.json").is_file() else None, str(found))
    named = [n for n in names if n]
    return _embedded(found=not named or any(EMBEDDED_MATCH in n.lower() for n in named))


def load_tokenizer(path: Path) -> Any:
    """A Hugging Face tokenizer from a local directory."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def read_config(config_dir: Path | None) -> dict[str, Any] | None:
    if config_dir is None:
        return None
    try:
        return json.loads((config_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None


def param_count(config: dict[str, Any] | None) -> int | None:
    """Parameters of a Llama-family decoder (Llama, Mistral, Qwen2/3) from its config.json, or None.

    Embeddings + per layer (q, k, v, o, gate, up, down, two norms) + final norm + an untied
    lm_head; biases and q/k norms are left out (well under 0.1 % for these models). None for a
    mixture of experts or latent attention, whose layers this formula does not describe.
    """
    if not config:
        return None
    cfg = config.get("text_config", config)
    if any(cfg.get(key) for key in ("num_local_experts", "num_experts", "n_routed_experts", "kv_lora_rank")):
        return None
    try:
        h = int(cfg["hidden_size"])
        inter = int(cfg["intermediate_size"])
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or h // heads)
        vocab = int(cfg["vocab_size"])
    except (KeyError, TypeError, ValueError):
        return None
    attn = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2
    per_layer = attn + 3 * h * inter + 2 * h
    tied = bool(cfg.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    return vocab * h * (1 if tied else 2) + layers * per_layer + h


def model_params(files: ModelFiles) -> int | None:
    """The parameter count of the model behind `files` (None if unknown or only assumed): from
    its config.json, or for the embedded model not converted under this cache root, from the
    tensor shapes of its GGUF file."""
    if not files.found:
        return None
    count = param_count(read_config(files.config_dir))
    if count is None and files.gguf is not None:
        import gguf

        reader = gguf.GGUFReader(str(files.gguf))
        count = sum(int(np.prod(t.shape)) for t in reader.tensors)
    return count
