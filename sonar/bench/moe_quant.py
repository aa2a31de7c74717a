"""`python -m sonar.bench.moe_quant`: one mixture-of-experts layer with quantized experts
(`sonar.models.moe.QuantizedExperts`) through the grouped operator (``sonar_cpu::moe_quant``: one
call for the layer) against the per-expert loop it replaced (`QuantizedExperts.per_expert`: each
active expert's rows through its own ``linear_quant`` calls, from Python), interleaved in one run.

Two shapes: Qwen3-30B-A3B's (h 2048, 128 experts of I 768, top 8; int4 in groups of 32 with
offsets, GGUF's Q4_1 / Q4_K layout) and gpt-oss-20b's (h 2880, 32 experts of I 2880, top 4;
MXFP4 with biases and the clamped SwiGLU). Random weights and a uniform random routing (the
kernels' cost does not depend on the values). Decode batches of 1 and 16 tokens, bfloat16 x.

`--threads 1` (the default): CPU time of the calling thread (``time.thread_time``), so the figures
hold on a machine other work is loading, as in `sonar.bench.quant_paths`. More threads: wall time.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sonar.bench.quant_paths import cpu_ms
from sonar.kernels import native, quant
from sonar.kernels.quant import QuantizedWeight
from sonar.kernels.quant_linear import QuantLinear
from sonar.models.moe import QuantizedExperts


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    format: str
    gpt_oss: bool


SHAPES = {
    "qwen3-moe": Shape("Qwen3-30B-A3B, int4 g32 + offsets", 2048, 768, 128, 8, "int4", False),
    "gpt-oss": Shape("gpt-oss-20b, mxfp4 + biases", 2880, 2880, 32, 4, "mxfp4", True),
}
GROUP = 32


def _weight(fmt: str, n: int, k: int, gen: torch.Generator) -> QuantizedWeight:
    groups = k // GROUP
    if fmt == "mxfp4":
        exponents = torch.randint(118, 124, (n, groups), generator=gen).to(torch.uint8)
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        return QuantizedWeight("mxfp4", codes, quant.mxfp4_scales(exponents), None, GROUP)
    values = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    return QuantizedWeight(
        fmt, values, torch.rand(n, groups, generator=gen) * 0.01, torch.randn(n, groups) * 0.01, GROUP
    )


def layer(shape: Shape, gen: torch.Generator) -> QuantizedExperts:
    block = QuantizedExperts(
        shape.experts,
        shape.hidden,
        shape.intermediate,
        swiglu_limit=7.0 if shape.gpt_oss else None,
        bias_device=torch.device("cpu"),
        bias_dtype=torch.bfloat16,
    )
    h, i = shape.hidden, shape.intermediate
    for expert in block:
        expert.gate_up_proj = QuantLinear(_weight(shape.format, 2 * i, h, gen), None)
        expert.down_proj = QuantLinear(_weight(shape.format, h, i, gen), None)
    for bias in (block.gate_up_proj_bias, block.down_proj_bias):
        if bias is not None:
            bias.data.copy_(torch.randn(bias.shape, generator=gen) * 0.01)
    return block


def wall_ms(fn: Callable[[], None], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best * 1000


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m sonar.bench.moe_quant", description=__doc__)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16], help="tokens of the decode batch")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per figure; the best is kept")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of both paths")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (more than 1: wall time)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not native.available():
        raise SystemExit("the native kernels are not available here")
    clock = cpu_ms if args.threads == 1 else wall_ms
    gen = torch.Generator().manual_seed(0)
    print(f"quantized path: {native.quant_isa()}; threads: {args.threads}")
    for key in args.shapes:
        shape = SHAPES[key]
        block = layer(shape, gen)
        stacked = block.stacked()
        assert stacked is not None
        nbytes = stacked.nbytes
        print(f"== {shape.name}: {shape.experts} experts, top {shape.top_k}, {nbytes / 2**20:.0f} MiB of experts")
        for tokens in args.tokens:
            x = torch.randn(tokens, shape.hidden, generator=gen).to(torch.bfloat16)
            ids = torch.stack([torch.randperm(shape.experts, generator=gen)[: shape.top_k] for _ in range(tokens)])
            weights = torch.softmax(torch.randn(ids.shape, generator=gen), dim=-1)
            grouped = torch.equal(block(x, weights, ids), block.per_expert(x, weights, ids))
            times: dict[str, list[float]] = {"grouped": [], "per_expert": []}
            for _ in range(args.rounds):
                times["grouped"].append(clock(lambda: block(x, weights, ids), args.repeats))
                times["per_expert"].append(clock(lambda: block.per_expert(x, weights, ids), args.repeats))
            g, p = (", ".join(f"{t:.2f}" for t in times[k]) for k in ("grouped", "per_expert"))
            ratio = min(times["per_expert"]) / min(times["grouped"])
            print(
                f"-- {tokens} token(s), {int((ids >= 0).sum())} pairs over {len(set(ids.flatten().tolist()))} experts"
                f" (ms per round, best of {args.repeats}); bit-equal: {grouped}"
            )
            print(f"grouped moe_quant      {g}")
            print(f"per-expert loop        {p}")
            print(f"per-expert / grouped   {ratio:.2f}x")


if __name__ == "__main__":
    main()
