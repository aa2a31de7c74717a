"""Sonar's native CPU kernels (``sonar/kernels/csrc/cpu_ops.cpp``): built once per machine, loaded as
torch operators ``torch.ops.sonar_cpu.*``.

Why: on a small CPU model, a decode step's attention (a gather of every sequence's context, then
SDPA over the padded grid) and its ~40 small element-wise ops per layer cost as much as the
linear layers. The kernels read the paged KV cache in place and fuse RMSNorm, rotary and
SiLU-and-mul into one pass each (`sonar.kernels.ops` dispatches to them on the CPU).

The build: ``g++ -O3 -march=native`` against the installed torch's headers and libraries (no
ninja, no Python headers: the operators register through ``TORCH_LIBRARY``), into
``$SONAR_CACHE_ROOT/native/<key>/`` where the key hashes the source, torch's version, the
compiler's and the CPU's flags. A build takes a few seconds, once; a cached one loads in
milliseconds. Concurrent builders of one key wait for the first (a file lock); the library is
written to a temporary file and renamed into place.

When no compiler is found or the build fails, a warning is logged once and every caller keeps the
torch references (same contracts). ``SONAR_NATIVE_KERNELS=0`` turns the kernels off (A/B checks).

The linear kernels (bfloat16 and quantized weights) have three paths each (`ISAS`): AVX-512
(compiled in by ``-march=native`` on a CPU with AVX512-BF16 and VNNI), AVX2 + FMA (compiled into
every x86 build through a target attribute) and a portable loop. The library runs the fastest one the CPU reports
(`best_isa` says which from ``/proc/cpuinfo``'s flags; the C++ side checks ``__builtin_cpu_supports``);
``SONAR_CPU_ISA=portable|avx2|avx512`` picks a slower one (tests, A/B measurements), and a path the
CPU cannot run is refused with `NativeIsaError`.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from sonar.errors import SonarError
from sonar.log import get_logger
from sonar.paths import cache_root

log = get_logger("sonar.kernels.native")

SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"
LIBRARY_NAME = "sonar_cpu_ops.so"
ENV = "SONAR_NATIVE_KERNELS"
ISA_ENV = "SONAR_CPU_ISA"
#: The quantized kernel's paths, slowest first.
ISAS = ("portable", "avx2", "avx512")
#: The CPU flags (``/proc/cpuinfo``'s names) each vector path needs.
ISA_FLAGS = {
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}),
    "avx2": frozenset({"avx2", "fma"}),
}


class NativeBuildError(SonarError, RuntimeError):
    """The C++ kernels did not compile (the message carries the compiler's output)."""


class NativeIsaError(SonarError, ValueError):
    """``SONAR_CPU_ISA`` names a path that is unknown or that this CPU cannot run."""


def enabled() -> bool:
    """Whether the native kernels may be used (``SONAR_NATIVE_KERNELS`` is not ``0``)."""
    return os.environ.get(ENV, "1") != "0"


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as ``/proc/cpuinfo`` lists them (empty where it is not readable)."""
    return frozenset(_cpu_flags().partition(":")[2].split())


@functools.cache
def amx_bf16() -> bool:
    """Whether oneDNN (``F.linear``, SDPA's flash kernel) runs bfloat16 products on AMX tiles here:
    the CPU has AMX-BF16 and the kernel lets this process use the tile state (torch asks for it
    once, as oneDNN would)."""
    return "amx_bf16" in cpu_flags() and bool(torch._C._cpu._init_amx())


def best_isa(flags: frozenset[str]) -> str:
    """The quantized kernel's fastest path for a CPU reporting `flags`."""
    for isa in ("avx512", "avx2"):
        if ISA_FLAGS[isa] <= flags:
            return isa
    return "portable"


def _command(compiler: str, output: Path, flags: tuple[str, ...] = ()) -> list[str]:
    root = Path(torch.__file__).parent
    return [
        compiler,
        "-O3",
        "-march=native",
        "-fno-math-errno",
        "-ffp-contract=off",
        "-fopenmp",
        "-fPIC",
        "-shared",
        "-std=c++20",
        "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        f"-I{root / 'include'}",
        f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
        str(SOURCE),
        "-o",
        str(output),
        f"-L{root / 'lib'}",
        "-lc10",
        "-ltorch_cpu",
        f"-Wl,-rpath,{root / 'lib'}",
        *flags,
    ]


def build_key(compiler: str, flags: tuple[str, ...] = ()) -> str:
    """What the built library depends on: the source, torch, the compiler and this CPU. Not
    where the source lies: its bytes are hashed, so another checkout of the same source (a clone,
    a git worktree) loads the library instead of compiling it again."""
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = compiler
    h = hashlib.sha256()
    for part in (
        SOURCE.read_bytes(),
        torch.__version__.encode(),
        version.encode(),
        _cpu_flags().encode(),
        " ".join(_command(compiler, Path("out"), flags)).replace(str(SOURCE), SOURCE.name).encode(),
    ):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def build(root: Path | None = None, flags: tuple[str, ...] = ()) -> Path:
    """The path of the built library, compiling it first unless the cache holds it. `flags` go
    to the compiler after the usual ones (the tests build the portable variant with
    ``-mno-avx512f``)."""
    compiler = _compiler()
    if compiler is None:
        raise NativeBuildError("no C++ compiler (g++ or $CXX) found")
    directory = (root or cache_root()) / "native" / build_key(compiler, flags)
    library = directory / LIBRARY_NAME
    if library.exists():
        return library
    directory.mkdir(parents=True, exist_ok=True)
    # Processes that start together on a cold cache (the ranks of a group, API servers, test
    # workers) would each spend a minute compiling the same library: the first builds, the
    # others wait on the lock and load its result.
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if library.exists():
            return library
        return _compile(compiler, flags, library)


def _compile(compiler: str, flags: tuple[str, ...], library: Path) -> Path:
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=library.parent)
    os.close(fd)
    started = time.perf_counter()
    try:
        result = subprocess.run(_command(compiler, Path(tmp), flags), capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise NativeBuildError(f"{SOURCE.name} did not compile:\n{result.stderr[-4000:]}")
        os.replace(tmp, library)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("native.built", seconds=round(time.perf_counter() - started, 1), path=str(library))
    return library


@functools.cache
def _load() -> bool:
    try:
        torch.ops.load_library(str(build()))
    except (NativeBuildError, OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("native.unavailable", detail="using the torch references", reason=str(e).splitlines()[0])
        return False
    _apply_isa(os.environ.get(ISA_ENV) or "auto")
    log.info("native.quant_isa", isa=str(torch.ops.sonar_cpu.quant_isa()), cpu_best=best_isa(cpu_flags()))
    return True


def set_quant_isa(name: str) -> None:
    """Run the linear kernels' `name` path (one of `ISAS`, or ``auto``: the fastest), bfloat16 and
    quantized alike."""
    if not available():
        raise NativeIsaError(f"{ISA_ENV}={name}: the native kernels are not available here")
    _apply_isa(name)


def _apply_isa(name: str) -> None:
    try:
        torch.ops.sonar_cpu.set_quant_isa(name)
    except RuntimeError as e:
        raise NativeIsaError(
            f"{ISA_ENV}={name}: {str(e).splitlines()[0].split(': ', 1)[-1]} (paths: auto, {', '.join(ISAS)})"
        ) from None


def quant_isa() -> str:
    """The path the linear kernels run now (``reference`` without the native kernels)."""
    return str(torch.ops.sonar_cpu.quant_isa()) if available() else "reference"


def available() -> bool:
    """Whether the native kernels are enabled and loaded (builds them on the first call)."""
    return enabled() and _load()


if __name__ == "__main__":  # scripts/_setup.sh builds the kernels ahead of the first server
    print(build())
