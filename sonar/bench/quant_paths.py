"""`python -m sonar.bench.quant_paths`: what one decode step's linear layers cost on each path of the
native quantized kernel (`sonar.kernels.native.ISAS`) this CPU runs, in bfloat16 and float32, against
dense ``F.linear`` on the same shapes.

The shapes are SmolLM2-135M's as the embedded Q4_1 file serves them: 30 layers of qkv 960x576,
o 576x576, gate_up 3072x576 and down 576x1536 in int4 (groups of 32, with offsets), and the tied
output layer 49152x576 in int8. Random weights and activations (the kernels' cost does not depend
on the values). One intra-op thread, and CPU time of the calling thread (``time.thread_time``), so
the figures hold on a machine other work is loading: wall time there measures the neighbours.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from sonar.kernels import native, quant_cpu
from sonar.kernels.quant import QuantizedWeight

LAYERS = 30
SHAPES = [(960, 576, "int4"), (576, 576, "int4"), (3072, 576, "int4"), (576, 1536, "int4")]
HEAD = (49152, 576, "int8")
GROUP = 32


def _weight(n: int, k: int, fmt: str, gen: torch.Generator) -> QuantizedWeight:
    values = (
        torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        if fmt == "int4"
        else torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    )
    scales = torch.rand(n, k // GROUP, generator=gen) * 0.01
    offsets = torch.randn(n, k // GROUP, generator=gen) * 0.01 if fmt == "int4" else None
    return QuantizedWeight(fmt, values, scales, offsets, GROUP)


def cpu_ms(fn: Callable[[], None], repeats: int) -> float:
    """The best of `repeats` runs of `fn`, in milliseconds of this thread's CPU time."""
    best = float("inf")
    for _ in range(repeats):
        started = time.thread_time()
        fn()
        best = min(best, time.thread_time() - started)
    return best * 1000


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m sonar.bench.quant_paths", description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16], help="rows of x (the batch of a decode)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per figure; the best is kept")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not native.available():
        raise SystemExit("the native kernels are not available here")
    gen = torch.Generator().manual_seed(0)
    layers = []
    for n, k, fmt in [*SHAPES, HEAD]:
        qw = _weight(n, k, fmt, gen)
        count = 1 if (n, k, fmt) == HEAD else LAYERS
        layers.append((n, k, fmt, count, quant_cpu.pack(qw), torch.randn(n, k, generator=gen)))
    runnable = native.ISAS[: native.ISAS.index(native.best_isa(native.cpu_flags())) + 1]
    print(f"CPU flags say: {native.best_isa(native.cpu_flags())}; paths run: {', '.join(runnable)}")
    for rows in args.rows:
        print(f"-- {rows} row(s): CPU ms per decode step ({LAYERS} layers + lm_head), best of {args.repeats}")
        for isa in runnable:
            native.set_quant_isa(isa)
            for dtype in (torch.bfloat16, torch.float32):
                xs = {k: torch.randn(rows, k, generator=gen).to(dtype) for _, k, *_ in layers}

                def quantized() -> None:
                    for n, k, fmt, count, packed, _ in layers:
                        for _ in range(count):
                            torch.ops.sonar_cpu.linear_quant(
                                xs[k], packed, None, quant_cpu.FORMAT_CODES[fmt], n, GROUP, fmt == "int4"
                            )

                print(f"linear_quant {isa:8s} {str(dtype)[6:]:9s} {cpu_ms(quantized, args.repeats):8.1f}")
        native.set_quant_isa("auto")
        for dtype in (torch.bfloat16, torch.float32):
            dense = [(w.to(dtype), torch.randn(rows, w.shape[1], generator=gen).to(dtype), c) for *_, c, _, w in layers]

            def plain() -> None:
                for w, x, count in dense:
                    for _ in range(count):
                        torch.nn.functional.linear(x, w)

            print(f"dense F.linear        {str(dtype)[6:]:9s} {cpu_ms(plain, args.repeats):8.1f}")


if __name__ == "__main__":
    main()
