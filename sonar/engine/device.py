"""Which device the worker runs on.

CUDA when torch sees a CUDA device, else the CPU. ``--device-ids N`` picks CUDA device ``N``
(Sonar serves from one device, so one index). ``SONAR_DEVICE`` overrides the choice: ``cpu``,
``cuda`` or ``cuda:N``; asking for CUDA where there is none is an error, not a silent CPU run.
"""

from __future__ import annotations

import os

import torch

from sonar.engine.settings import parse_device_ids

DEVICE_ENV = "SONAR_DEVICE"


def select_device(
    device_ids: str | None = None, env: dict[str, str] | None = None, cuda_available: bool | None = None
) -> torch.device:
    """The worker's device (see the module docstring). ``env`` and ``cuda_available`` default to
    the process's environment and ``torch.cuda.is_available()``."""
    env = os.environ if env is None else env
    available = torch.cuda.is_available() if cuda_available is None else cuda_available
    index = parse_device_ids(device_ids)
    forced = env.get(DEVICE_ENV, "").strip().lower()
    if forced:
        if forced == "cpu":
            return torch.device("cpu")
        if forced != "cuda" and not (forced.startswith("cuda:") and forced[5:].isdigit()):
            raise ValueError(f"{DEVICE_ENV}={forced!r}: expected cpu, cuda or cuda:N")
        if not available:
            raise RuntimeError(f"{DEVICE_ENV}={forced} but torch sees no CUDA device")
        if forced.startswith("cuda:"):
            return torch.device(forced)
    elif not available:
        return torch.device("cpu")
    device = torch.device("cuda", index or 0)
    count = torch.cuda.device_count()
    if device.index >= count:
        raise ValueError(f"CUDA device {device.index} does not exist (torch sees {count})")
    return device


def memory_info(device: torch.device) -> tuple[int, int]:
    """``(free, total)`` bytes of a CUDA device."""
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)
