"""Packed quantized weights kept on disk, so a warm start skips the packing.

A backend packs each quantized matrix into the layout its kernel reads (`QuantLinear`); for the
embedded model that is seconds of tensor shuffling on every start. `PackCache` keeps the packed
tensors of one checkpoint in one safetensors file beside it and hands them back by module name.

What makes an entry valid: the file's stamp (the source checkpoint's size and mtime, and a hash
of the packing code: ``sonar/kernels/quant*.py``) matches, and the entry was packed by the same
backend for the same logical weight (format, shape, group, offsets, permutation). Anything else,
a file that does not parse included, is a miss: the weight is packed again and the file rewritten
(atomically). The data is not hashed: a file truncated or rewritten by hand is caught by its
header and shapes, silent bit rot inside a tensor is not (as for every cache under the root).
Only CPU tensors are cached.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

import structlog
from torch import Tensor

from sonar.kernels.quant_linear import Backend, QuantMeta

log = structlog.get_logger(__name__)

_PACKING_SOURCES = ("quant.py", "quant_cpu.py", "quant_linear.py", "quant_triton.py")


@functools.cache
def packing_code_hash() -> str:
    """A hash of the modules that define the packed layouts (a change there repacks once)."""
    kernels = Path(__file__).resolve().parent.parent / "kernels"
    h = hashlib.sha256()
    for name in _PACKING_SOURCES:
        h.update((kernels / name).read_bytes())
    return h.hexdigest()[:16]


def source_stamp(source: Path, code: str | None = None) -> str:
    """What the cache of `source` depends on: its size and mtime, and the packing code."""
    st = source.stat()
    return f"{st.st_size}-{st.st_mtime_ns}-{code or packing_code_hash()}"


def _describe(meta: QuantMeta, backend: str) -> str:
    return (
        f"{backend}/{meta.format}/{meta.out_features}x{meta.in_features}/{meta.group}/"
        f"{int(meta.has_offsets)}{int(meta.has_perm)}"
    )


class PackCache:
    """The packed weights of one checkpoint (`source`), cached in the file `path`."""

    def __init__(self, path: Path, source: Path, *, code: str | None = None) -> None:
        self.path = path
        self.stamp = source_stamp(source, code)
        self.layout: dict[str, str] = {}
        self.tensors: dict[str, Tensor] = {}
        self.hits = 0
        self.misses = 0
        self._packed: dict[str, tuple[str, dict[str, Tensor]]] = {}
        if path.is_file():
            self._read()

    def _read(self) -> None:
        from safetensors import safe_open

        try:
            with safe_open(str(self.path), framework="pt", device="cpu") as handle:
                meta = handle.metadata() or {}
                if meta.get("stamp") != self.stamp:
                    log.info("model.pack_cache_stale", path=str(self.path))
                    return
                layout = json.loads(meta["layout"])
                tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (not a dict)
        except Exception as exc:  # unreadable: packed again and rewritten
            log.warning("model.pack_cache_unreadable", path=str(self.path), error=str(exc))
            return
        self.layout, self.tensors = layout, tensors

    def get(self, module: str, meta: QuantMeta, backend: Backend) -> dict[str, Tensor] | None:
        """The packed tensors of `module` when the cache holds them for this weight and backend."""
        packed = None
        if self.layout.get(module) == _describe(meta, backend.name):
            prefix = f"{module}:"
            packed = {k.removeprefix(prefix): t for k, t in self.tensors.items() if k.startswith(prefix)}
        if packed:
            self.hits += 1
            return packed
        self.misses += 1
        return None

    def put(self, module: str, meta: QuantMeta, backend: Backend, packed: dict[str, Tensor]) -> None:
        """Remember what `module` packed to (written by `save`)."""
        self._packed[module] = (_describe(meta, backend.name), packed)

    def save(self) -> None:
        """Write the file when any weight missed (every weight the model holds, so later starts hit)."""
        if not self.misses or not self._packed:
            return
        from safetensors.torch import save_file

        tensors: dict[str, Tensor] = {}
        layout: dict[str, str] = {}
        for module, (described, packed) in self._packed.items():
            if any(t.device.type != "cpu" for t in packed.values()):
                return
            layout[module] = described
            tensors.update({f"{module}:{name}": t.contiguous() for name, t in packed.items()})
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        try:
            save_file(tensors, str(tmp), metadata={"stamp": self.stamp, "layout": json.dumps(layout)})
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("model.pack_cache_not_written", path=str(self.path), error=str(exc))
        finally:
            tmp.unlink(missing_ok=True)
