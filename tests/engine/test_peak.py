"""The device peaks MFU is measured against."""

from __future__ import annotations

from sonar.engine.peak import cpu_peak_flops, peak_flops

CPUINFO = "processor\t: 0\ncpu MHz\t\t: 2000.000\nflags\t\t: fpu sse2 avx avx2 fma {extra}\n"


def test_cpu_peak_is_cores_times_clock_times_vector_flops() -> None:
    assert cpu_peak_flops(CPUINFO.format(extra=""), max_khz=3_000_000, cores=4) == 4 * 3e9 * 32
    assert cpu_peak_flops(CPUINFO.format(extra="avx512f"), max_khz=3_000_000, cores=4) == 4 * 3e9 * 64
    # no cpufreq in sysfs: the current clock of /proc/cpuinfo
    no_sysfs = cpu_peak_flops(CPUINFO.format(extra=""), cores=1)
    assert no_sysfs > 0


def test_this_machines_cpu_peak_is_known() -> None:
    assert peak_flops("cpu", "", "float32") > 1e9


def test_cuda_peaks_by_name_and_dtype() -> None:
    assert peak_flops("cuda", "NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
    assert peak_flops("cuda", "NVIDIA H100 PCIe", "float16") == 756e12
    assert peak_flops("cuda", "NVIDIA H200", "bfloat16") == 989e12
    assert peak_flops("cuda", "NVIDIA A100-SXM4-80GB", "bfloat16") == 312e12
    assert peak_flops("cuda", "NVIDIA L4", "bfloat16") == 121e12
    assert peak_flops("cuda", "NVIDIA L40S", "bfloat16") == 362e12
    assert peak_flops("cuda", "Some Future GPU", "bfloat16") == 0.0
    assert peak_flops("cuda", "NVIDIA H100 80GB HBM3", "float32") == 0.0
