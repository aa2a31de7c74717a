"""Reading checkpoint tensors from safetensors files (one file or a sharded index) and dummy weights."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from sonar.models.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of a directory: those its sharded index names, else every ``*.safetensors``."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"corrupt safetensors index {index}: {exc}") from exc
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} names shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {model_dir}")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor of every file; a file that cannot be read raises ModelLoadError."""
    from safetensors import safe_open

    for path in files:
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
            names = list(handle.keys())
        except Exception as exc:
            raise ModelLoadError(f"corrupt safetensors file {path}: {exc}") from exc
        for name in names:
            try:
                tensor = handle.get_tensor(name)
            except Exception as exc:
                raise ModelLoadError(f"corrupt safetensors file {path}: tensor {name}: {exc}") from exc
            yield name, tensor


def init_dummy_weights(model: nn.Module, std: float = 0.02, seed: int = 0) -> None:
    """Random weights for benchmarks and tests without a checkpoint: norms 1, biases 0, the rest N(0, std)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in model.named_parameters():
        data = param.data
        if name.lower().endswith("norm.weight"):  # RMSNorm and BERT's LayerNorm
            data.fill_(1.0)
        elif name.endswith(".bias"):
            data.zero_()
        else:
            values = torch.empty(data.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
            data.copy_(values)
