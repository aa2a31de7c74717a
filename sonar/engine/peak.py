"""The device's peak FLOP/s, the denominator of ``--enable-mfu-metrics``' utilization.

- CUDA: the vendor's dense 16-bit tensor-core figure for the GPUs Sonar recognises by name
  (`CUDA_PEAKS`, matched against ``torch.cuda.get_device_name``), for a bfloat16 or float16
  model; unknown (0) for other GPUs and dtypes.
- CPU: cores x clock x FLOPs per cycle and core, from ``/proc/cpuinfo`` and sysfs: the cores this
  process may run on, the highest clock the kernel reports (``cpuinfo_max_freq``, else the
  current ``cpu MHz``), and two fused multiply-add units of the widest vector extension the CPU
  has (AVX-512: 16 float32 lanes, AVX2 with FMA: 8; else 4 lanes without FMA), 2 FLOPs per lane
  and FMA. It is a ceiling: the kernels reach a fraction of it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["CUDA_PEAKS", "cpu_peak_flops", "peak_flops"]

#: Dense bfloat16/float16 tensor FLOP/s by a name fragment (more specific fragments first).
CUDA_PEAKS: tuple[tuple[str, float], ...] = (
    ("B200", 2250e12),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("RTX 4090", 165e12),
    ("V100", 125e12),
    ("T4", 65e12),
)


def peak_flops(device: str, device_name: str, dtype: str) -> float:
    """The peak FLOP/s of one `device` ("cuda", "cpu") for a `dtype` model; 0.0 when unknown."""
    if device == "cuda":
        if dtype not in ("bfloat16", "float16"):
            return 0.0
        return next((peak for fragment, peak in CUDA_PEAKS if fragment in device_name), 0.0)
    if device == "cpu":
        return cpu_peak_flops()
    return 0.0


def cpu_peak_flops(cpuinfo: str | None = None, max_khz: int | None = None, cores: int | None = None) -> float:
    """The CPU's float32 peak (see the module docstring); the arguments stand in for what is read
    from the machine."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return 0.0
    if max_khz is None:
        try:
            max_khz = int(Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").read_text())
        except (OSError, ValueError):
            mhz = re.search(r"^cpu MHz\s*:\s*([\d.]+)", cpuinfo, re.MULTILINE)
            max_khz = int(float(mhz.group(1)) * 1000) if mhz else 0
    if cores is None:
        cores = len(os.sched_getaffinity(0))
    flags_line = re.search(r"^flags\s*:(.*)$", cpuinfo, re.MULTILINE)
    flags = set(flags_line.group(1).split()) if flags_line else set()
    if "avx512f" in flags:
        per_cycle = 2 * 16 * 2
    elif "avx2" in flags and "fma" in flags:
        per_cycle = 2 * 8 * 2
    else:
        per_cycle = 4 * 2
    return float(cores * max_khz * 1000 * per_cycle)
