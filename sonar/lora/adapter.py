"""LoRA adapters in PEFT's format: a folder with ``adapter_config.json`` and
``adapter_model.safetensors``, read and checked against the base model.

What is served: LoRA (not DoRA) on the decoder layers' q/k/v/o and gate/up/down projections, any
rank up to ``--max-lora-rank`` (per module too: ``rank_pattern``), scaled by ``lora_alpha / r``
(``alpha_pattern`` per module) or ``lora_alpha / sqrt(r)`` with ``use_rslora``. Everything else an
adapter may carry changes the model in ways the batched kernels do not compute (trained biases,
embedding or LM-head adapters, extra saved modules, DoRA's magnitudes), so it is refused by name:
an adapter is served exactly or not at all. Pickled ``adapter_model.bin`` files are refused too:
loading one runs code from the file.

The adapter's identity is a digest of its two files, not its name: the prefix cache keys blocks by
it (two adapters never share KV, a reloaded identical adapter does), and the worker checks the
files it reads later still have it.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from sonar.errors import LoRAError
from sonar.lora.limits import MODULES, LoRALimits, ModelShapes

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

_TENSOR_NAME = re.compile(
    r"^(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(" + "|".join(MODULES) + r")\.lora_([AB])(?:\.default)?\.weight$"
)

#: adapter_config.json keys whose non-default values change the model beyond what is served.
_REFUSED_KEYS: dict[str, str] = {
    "use_dora": "DoRA adapters (use_dora) are not supported",
    "modules_to_save": "modules_to_save (fully trained extra modules) is not supported",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights) is not supported",
    "layer_replication": "layer_replication is not supported",
    "target_parameters": "target_parameters (LoRA on raw parameters) is not supported",
    "trainable_token_indices": "trainable_token_indices (trained embedding rows) is not supported",
    "use_qalora": "QALoRA adapters (use_qalora) are not supported",
    "lora_bias": "lora_bias (a trained bias on lora_B) is not supported",
}


@dataclass(frozen=True)
class LoRAWeights:
    """An adapter's factors, ready for the slots: ``factors[(layer, module)] = (A, B)`` with A
    ``[r, in]`` and B ``[out, r]`` already multiplied by the module's scaling, both float32 on the
    CPU."""

    factors: dict[tuple[int, str], tuple[Tensor, Tensor]]
    rank: int
    """The largest rank of any module."""
    digest: str


def file_digest(path: str | Path) -> str:
    """The identity of the adapter in folder `path`: SHA-256 over its config, then its weights."""
    folder = Path(path)
    digest = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        with open(folder / name, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def _pattern_value(patterns: dict[str, Any], module_path: str, default: Any) -> Any:
    """PEFT's per-module override: the value of the first key that matches the end of the
    module's dotted path, else `default`."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module_path):
            return value
    return default


def _read_config(folder: Path) -> dict[str, Any]:
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise LoRAError(f"{folder} has no {CONFIG_FILE} (a PEFT adapter folder holds it)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRAError(f"cannot read {folder / CONFIG_FILE}: {exc}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{folder / CONFIG_FILE} is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAError(f"peft_type {peft_type!r} is not supported (only LORA adapters are)")
    for key, why in _REFUSED_KEYS.items():
        if config.get(key):
            raise LoRAError(f"{why}: {key} = {config[key]!r} in {CONFIG_FILE}")
    bias = config.get("bias", "none")
    if bias != "none":
        raise LoRAError(f'bias {bias!r} (trained biases) is not supported: only "none"')
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise LoRAError(f"r must be a positive integer in {CONFIG_FILE}, got {r!r}")
    alpha = config.get("lora_alpha", r)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAError(f"lora_alpha must be a number in {CONFIG_FILE}, got {alpha!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise LoRAError(f"{key} must be an object in {CONFIG_FILE}")
    return config


def read_adapter(path: str | Path, shapes: ModelShapes, limits: LoRALimits) -> LoRAWeights:
    """Read and check the adapter in folder `path` against the base model and the server's
    limits; raises `LoRAError` saying what is wrong (the file, the key, the module)."""
    folder = Path(path)
    if not folder.is_dir():
        raise LoRAError(f"LoRA adapter path {str(path)!r} is not a directory")
    config = _read_config(folder)
    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file():
        pickled = (folder / "adapter_model.bin").exists()
        raise LoRAError(
            f"{folder} has no {WEIGHTS_FILE}"
            + (
                " (adapter_model.bin is refused: unpickling it runs code from the file; convert it to safetensors)"
                if pickled
                else ""
            )
        )
    digest = file_digest(folder)
    r, alpha = config["r"], config.get("lora_alpha", config["r"])
    rslora = bool(config.get("use_rslora", False))
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    halves: dict[tuple[int, str], dict[str, Tensor]] = {}
    paths: dict[tuple[int, str], str] = {}
    try:
        with safe_open(weights_path, framework="pt") as f:
            for name in f.keys():
                match = _TENSOR_NAME.match(name)
                if match is None:
                    raise LoRAError(
                        f"tensor {name!r} is not a LoRA factor of a supported projection "
                        f"({', '.join(MODULES)}); embedding, LM-head and other modules' adapters are not supported"
                    )
                layer, module, half = int(match[1]), match[2], match[3]
                if layer >= shapes.num_layers:
                    raise LoRAError(f"tensor {name!r} is for layer {layer}; the base model has {shapes.num_layers}")
                key = (layer, module)
                halves.setdefault(key, {})[half] = f.get_tensor(name)
                paths[key] = name.split(".lora_")[0]
    except SafetensorError as exc:
        raise LoRAError(f"cannot read {weights_path}: {exc}") from None
    if not halves:
        raise LoRAError(f"{weights_path} holds no LoRA factors")
    factors: dict[tuple[int, str], tuple[Tensor, Tensor]] = {}
    max_rank = 0
    for (layer, module), pair in sorted(halves.items()):
        where = f"layer {layer} {module}"
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"{where}: lora_{'B' if 'A' in pair else 'A'} is missing")
        a, b = pair["A"], pair["B"]
        if not (a.is_floating_point() and b.is_floating_point()) or a.dim() != 2 or b.dim() != 2:
            raise LoRAError(f"{where}: lora_A and lora_B must be 2-D float tensors")
        rank = a.shape[0]
        fan_in, fan_out = shapes.modules[module]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise LoRAError(
                f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the base model's "
                f"projection ({fan_in} -> {fan_out}): expected ({rank}, {fan_in}) and ({fan_out}, {rank})"
            )
        expected = _pattern_value(rank_pattern, paths[(layer, module)], r)
        if rank != expected:
            raise LoRAError(f"{where}: rank {rank}, but {CONFIG_FILE} says {expected}")
        if rank > limits.max_rank:
            raise LoRAError(f"{where}: rank {rank} exceeds --max-lora-rank {limits.max_rank}")
        if not limits.targets(module):
            raise LoRAError(
                f"{where}: the server applies adapters only to {', '.join(sorted(limits.target_modules or ()))} "
                "(--lora-target-modules); serving this adapter without its other factors would change what it does"
            )
        module_alpha = _pattern_value(alpha_pattern, paths[(layer, module)], alpha)
        scaling = module_alpha / (math.sqrt(rank) if rslora else rank)
        factors[(layer, module)] = (a.float().contiguous(), (b.float() * scaling).contiguous())
        max_rank = max(max_rank, rank)
    if not all(torch.isfinite(t).all() for pair in factors.values() for t in pair):
        raise LoRAError(f"{weights_path} holds non-finite values (inf or NaN)")
    return LoRAWeights(factors=factors, rank=max_rank, digest=digest)
