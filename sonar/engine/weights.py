"""Weight updates on the worker's side (``--weight-transfer-config``): new weights written into
the runner's parameters in place, between steps (the worker holds its step lock).

What the update must fit is the served checkpoint's manifest (`sonar.core.weights`), read from
its safetensors headers (the header alone: no tensor is read). Everything is checked before the
first parameter is written, so a refused update leaves the old weights whole. Writing goes through
the model's own `load_weights` (the one startup used: fused projections, tied embeddings, casts),
in place, so CUDA graphs and compiled graphs, which hold the parameters' addresses, stay valid;
the CPU's prepacked copies of linear weights are packed again. On the CPU the linear weights that
live only in their packed copy (`sonar.kernels.linear.materialized`) are unpacked for the update
and given up again after it: for its length the weights take twice their memory.

Served from anything but unquantized safetensors (a GGUF file, a quantized checkpoint, PyTorch
``.bin`` files, ``--load-format dummy``) the model has no manifest, and updates are refused.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from sonar.core.weights import Manifest, TensorSpec, WeightUpdateConflictError, WeightUpdateError, check_update
from sonar.engine.runner import ModelRunner
from sonar.kernels.linear import PackedLinear, materialized
from sonar.log import get_logger
from sonar.models.errors import ModelLoadError
from sonar.models.weights import has_safetensors, iter_safetensors, safetensors_files
from sonar.protocol.engine import WeightsUpdated

log = get_logger("sonar.worker")

SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
MAX_HEADER_BYTES = 100 * 2**20
"""A safetensors header larger than this is taken as a corrupt file (the format's own limit)."""


def read_manifest(model_dir: Path) -> Manifest:
    """Name, shape and dtype of every tensor of the safetensors checkpoint in `model_dir`."""
    manifest: Manifest = {}
    for path in safetensors_files(model_dir):
        try:
            with path.open("rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                if size > MAX_HEADER_BYTES:
                    raise ValueError(f"a header of {size} bytes")
                header = json.loads(f.read(size))
            for name, entry in header.items():
                if name != "__metadata__":
                    manifest[name] = TensorSpec(
                        tuple(entry["shape"]), SAFETENSORS_DTYPES.get(entry["dtype"], "unknown")
                    )
        except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
            raise WeightUpdateError(f"{path} is not a readable safetensors file: {exc}") from None
    return manifest


def tensor_manifest(tensors: Mapping[str, torch.Tensor]) -> Manifest:
    return {name: TensorSpec(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in tensors.items()}


def _architectures(config: Any) -> list[str]:
    return list(getattr(config, "architectures", None) or [])


class WeightUpdater:
    """Checks and applies weight updates to the worker's runner."""

    def __init__(self, runner: ModelRunner) -> None:
        loaded = runner.loaded
        cfg = runner.config
        why = None
        if loaded.quantization is not None or loaded.quantized is not None:
            why = f"it is served quantized ({loaded.quantization})"
        elif cfg.load_format not in ("auto", "safetensors", "runai_streamer") or not has_safetensors(loaded.model_dir):
            why = f"it was not loaded from safetensors weights (load format {cfg.load_format})"
        self.refused = (
            None
            if why is None
            else f"weight updates need a model served whole from unquantized safetensors weights; {loaded.source}: {why}"
        )
        self._manifest: Manifest | None = None
        self.model_dir = loaded.model_dir
        self.architectures = _architectures(loaded.config)
        self.dtype = str(loaded.dtype).removeprefix("torch.")
        self.updates = 0

    def manifest(self) -> Manifest:
        if self._manifest is None:
            self._manifest = read_manifest(self.model_dir)
        return self._manifest

    def apply(self, runner: ModelRunner | None, path: str | None, tensors: Mapping[str, Any] | None) -> WeightsUpdated:
        """Write the checkpoint at `path`, or `tensors`, into `runner`'s parameters (`WeightUpdateError`
        and nothing written when they do not fit)."""
        if self.refused is not None:
            raise WeightUpdateError(self.refused)
        if runner is None:
            raise WeightUpdateConflictError(
                "the weights are asleep (level 2): wake them up (tags weights) before updating them"
            )
        started = time.perf_counter()
        served = self.manifest()
        if path is not None:
            folder = Path(path)
            update, stream = self._checkpoint(folder)
            check_update(served, update, whole=True, dtype=None)
            source = str(folder)
        else:
            assert tensors is not None
            bad = [name for name, t in tensors.items() if not isinstance(t, torch.Tensor)]
            if bad:
                raise WeightUpdateError(f"weight {bad[0]} is not a tensor")
            update = tensor_manifest(tensors)
            check_update(served, update, whole=False, dtype=self.dtype)
            stream, source = iter(tensors.items()), "tensors"
        nbytes = 0

        def counted() -> Any:
            nonlocal nbytes
            for name, tensor in stream:
                nbytes += tensor.nbytes
                yield name, tensor

        with torch.no_grad(), materialized(runner.model):
            runner.model.load_weights(counted())
            for module in runner.model.modules():
                if isinstance(module, PackedLinear):
                    module.repack()
        runner.encoder_cache.clear()  # rows the old tower gave
        self.updates += 1
        seconds = time.perf_counter() - started
        log.info("worker.weights_updated", source=source, tensors=len(update), bytes=nbytes, seconds=round(seconds, 3))
        return WeightsUpdated(len(update), nbytes, round(seconds, 3), self.updates)

    def _checkpoint(self, folder: Path) -> tuple[Manifest, Any]:
        if not folder.is_dir():
            raise WeightUpdateError(f"weight update path {str(folder)!r} is not a directory")
        config_file = folder / "config.json"
        if config_file.is_file():
            try:
                architectures = json.loads(config_file.read_text()).get("architectures") or []
            except (OSError, ValueError, AttributeError) as exc:
                raise WeightUpdateError(f"{config_file} is not a readable config: {exc}") from None
            if architectures != self.architectures:
                raise WeightUpdateError(
                    f"{folder} holds a {', '.join(architectures) or 'model without architectures'}; "
                    f"the served model is a {', '.join(self.architectures)}"
                )
        try:
            files = safetensors_files(folder)
        except ModelLoadError as exc:
            raise WeightUpdateError(str(exc)) from None
        return read_manifest(folder), iter_safetensors(files)
