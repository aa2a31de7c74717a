"""`python -m sonar.bench.mxfp4_expert`: one gpt-oss-20b expert's two products (``gate_up_proj``
5760x2880 and ``down_proj`` 2880x2880) with its weights in MXFP4 through the native kernel, against
dense ``F.linear`` over the same weights dequantized to bfloat16 and to float32 (what
``--dequantize-weights`` serves), at the given rows of x (the tokens routed to the expert).

Random codes and exponents (the kernels' cost does not depend on the values). One intra-op
thread, and CPU time of the calling thread (``time.thread_time``), so the figures hold on a
machine other work is loading, as in `sonar.bench.quant_paths`. The bytes printed are the
weights' as each path holds them.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from sonar.bench.quant_paths import cpu_ms
from sonar.kernels import native, quant, quant_cpu
from sonar.kernels.quant import QuantizedWeight

HIDDEN = INTERMEDIATE = 2880
#: (rows, columns) of the expert's products, as a linear layer's weight
SHAPES = [(2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
GROUP = 32


def _weight(n: int, k: int, gen: torch.Generator) -> QuantizedWeight:
    exponents = torch.randint(118, 124, (n, k // GROUP), generator=gen).to(torch.uint8)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    return QuantizedWeight("mxfp4", codes, quant.mxfp4_scales(exponents), None, GROUP)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m sonar.bench.mxfp4_expert", description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16], help="rows of x (tokens routed to the expert)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per figure; the best is kept")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not native.available():
        raise SystemExit("the native kernels are not available here")
    gen = torch.Generator().manual_seed(0)
    weights = [_weight(n, k, gen) for n, k in SHAPES]
    packed = [quant_cpu.pack(qw) for qw in weights]
    dense = {dtype: [quant.dequantize(qw, dtype) for qw in weights] for dtype in (torch.bfloat16, torch.float32)}
    mxfp4_bytes = sum(p.nbytes for p in packed)
    print(
        f"quantized path: {native.quant_isa()}; weights: mxfp4 {mxfp4_bytes / 2**20:.1f} MiB, "
        f"bfloat16 {sum(w.nbytes for w in dense[torch.bfloat16]) / 2**20:.1f} MiB"
    )
    for rows in args.rows:
        print(f"-- {rows} row(s): CPU ms for the expert's two products, best of {args.repeats}")
        for dtype in (torch.bfloat16, torch.float32):
            xs = [torch.randn(rows, k, generator=gen).to(dtype) for _, k in SHAPES]

            def quantized() -> None:
                for x, p, (n, _) in zip(xs, packed, SHAPES, strict=True):
                    torch.ops.sonar_cpu.linear_quant(x, p, None, quant_cpu.FORMAT_CODES["mxfp4"], n, GROUP, False)

            def plain() -> None:
                for x, w in zip(xs, dense[dtype], strict=True):
                    F.linear(x, w)

            name = str(dtype).removeprefix("torch.")
            print(f"mxfp4 linear_quant   x {name:9s} {cpu_ms(quantized, args.repeats):8.2f}")
            print(f"dense F.linear {name:9s}         {cpu_ms(plain, args.repeats):8.2f}")


if __name__ == "__main__":
    main()
