"""Weight updates for RL loops (``--weight-transfer-config``): the settings and the checks, as
plain values.

A running engine takes new weights from a checkpoint folder on disk or from tensors sent over
Sonar's own transport (msgspec frames over ZMQ), between steps. Before a single parameter is
written, the update is checked against the *manifest* of the model being served (each
checkpoint tensor's name, shape and dtype, read from the safetensors headers it was loaded
from): an unknown name, a shape that differs, or a tensor sent in another dtype than the one
served is refused (`WeightUpdateError`), and the old weights stay. A checkpoint folder must hold
every tensor of the served one (a whole model); tensors sent over the transport may be any
subset (one call per chunk, each applied whole).

Backends: ``sonar`` (both ways above). Collective groups between a trainer and the workers
(vLLM's ``nccl`` and ``ipc``, and ``gloo``) are refused by name: a trainer's broadcast into a
group has no way to learn that the server refused the update, and would hang.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from sonar.errors import SonarError

BACKENDS = ("sonar",)
REFUSED_BACKENDS = {
    "nccl": "an NCCL group between the trainer and the workers",
    "ipc": "CUDA IPC handles shared with a trainer on the same GPU",
    "gloo": "a torch.distributed gloo group between the trainer and the workers",
}
DEFAULT_MAX_UPDATE_BYTES = 2 * 2**30
"""Bytes of tensors one update over the transport may carry, unless the config says otherwise."""


class WeightUpdateError(SonarError, ValueError):
    """A weight update that does not fit the served model (a name it lacks, a shape or dtype that
    differs, another architecture). Nothing was written: the engine serves the weights it had."""

    status = 400


class WeightUpdateConflictError(WeightUpdateError):
    """A weight update that cannot happen now: another one is under way, or the weights sleep at
    level 2. Nothing was written; HTTP answers 409."""

    status = 409


class WeightTransferConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    backend: str = "sonar"
    max_update_bytes: int = DEFAULT_MAX_UPDATE_BYTES
    """The most bytes of tensors one `update_weights` call sends (split a bigger update)."""

    @classmethod
    def parse(cls, raw: Mapping[str, Any] | None) -> WeightTransferConfig | None:
        """The config of ``--weight-transfer-config`` (None when unset; ``{}``: the defaults);
        ValueError naming a bad field."""
        if raw is None:
            return None
        try:
            config = msgspec.convert(dict(raw), cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"--weight-transfer-config: {exc}") from None
        if config.backend in REFUSED_BACKENDS:
            raise ValueError(
                f"--weight-transfer-config backend {config.backend!r} ({REFUSED_BACKENDS[config.backend]}) is not "
                "supported; backend 'sonar' takes a checkpoint path or tensors over Sonar's own transport"
            )
        if config.backend not in BACKENDS:
            raise ValueError(
                f"--weight-transfer-config: unknown backend {config.backend!r}; the backends are {', '.join(BACKENDS)}"
            )
        if config.max_update_bytes <= 0:
            raise ValueError(
                f"--weight-transfer-config: max_update_bytes must be positive, got {config.max_update_bytes}"
            )
        return config


class TensorSpec(msgspec.Struct, frozen=True, array_like=True):
    shape: tuple[int, ...]
    dtype: str
    """torch's name without the ``torch.`` prefix: ``bfloat16``, ``float32``."""


Manifest = dict[str, TensorSpec]
"""Checkpoint tensor name -> its shape and dtype."""


def _shown(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def check_update(served: Manifest, update: Manifest, *, whole: bool, dtype: str | None) -> None:
    """Refuse `update` unless it fits `served`: every name known and of the same shape, and, with
    `whole` (a checkpoint folder), every served name present. `dtype`: the dtype tensors must come
    in (the served one, for tensors over the transport); None: any floating dtype, cast as at
    startup (a checkpoint)."""
    if not update:
        raise WeightUpdateError("the weight update holds no tensor")
    unknown = sorted(set(update) - set(served))
    if unknown:
        raise WeightUpdateError(f"the served model has no weight named {_shown(unknown)}")
    if whole:
        missing = sorted(set(served) - set(update))
        if missing:
            raise WeightUpdateError(f"the new checkpoint lacks {_shown(missing)}")
    for name, spec in update.items():
        if spec.shape != served[name].shape:
            raise WeightUpdateError(
                f"weight {name} has shape {list(spec.shape)}, the model's is {list(served[name].shape)}"
            )
        if dtype is not None and spec.dtype != dtype:
            raise WeightUpdateError(f"weight {name} is {spec.dtype}; send it in the served dtype, {dtype}")
        if dtype is None and not spec.dtype.startswith(("float", "bfloat")):
            raise WeightUpdateError(f"weight {name} is {spec.dtype}, not a floating-point tensor")
