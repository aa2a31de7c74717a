"""Kernel benchmark on the GPU: each Triton kernel's time at a real shape (``triton.testing.do_bench``,
median), the bandwidth or FLOP rate it achieves, and that as a share of the device's ceilings
measured here (a large device-to-device copy and a large read for HBM bandwidth, an 8192^3 bf16
matmul for FLOP/s). Every timed output is first checked against the torch reference.

The headline is decode attention at batch 64 x 4096 context (Llama-3-8B heads: 32 query, 8 KV,
head_dim 128, bf16), whose target is >= 70% of the measured HBM bandwidth. The last section is the
model runner: a Qwen3-0.6B-shaped model decoding at batch 1, eager and with CUDA graphs, against
the weight-bandwidth floor (`tests_gpu.bench_decode`; target: graphs within 2x of the floor).

    python -m tests_gpu.bench_kernels [--json PATH] [--markdown PATH] [--junit PATH] [--quick]

``--junit`` adds a row for a pytest run of ``tests_gpu`` (its JUnit XML). The table comes last;
the exit status is 1 if any row fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import asdict, dataclass

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

from tests_gpu.cases import PagedBatch  # noqa: E402

HEADLINE_TARGET = 0.70


@dataclass
class Row:
    kernel: str
    shape: str
    ms: float | None
    rate: float | None  # GB/s or TFLOP/s
    unit: str
    pct: float | None  # of the matching ceiling
    ok: bool
    note: str = ""


def bench(fn: Callable[[], object], quick: bool) -> float:
    """Median milliseconds of ``fn`` (L2 flushed between runs by do_bench)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10 if quick else 25, rep=40 if quick else 100, return_mode="median"))


def gbps(nbytes: float, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def tflops(flop: float, ms: float) -> float:
    return flop / (ms * 1e-3) / 1e12


# --- ceilings ------------------------------------------------------------------------------------------


def measure_ceilings(quick: bool) -> tuple[float, float, list[Row]]:
    n = 1 << 30  # 1 Gi bf16 elements: 2 GiB a buffer, far past L2
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    copy_ms = bench(lambda: y.copy_(x), quick)
    copy_bw = gbps(2 * x.nbytes, copy_ms)
    read_ms = bench(lambda: torch.sum(x, dtype=torch.float32), quick)
    read_bw = gbps(x.nbytes, read_ms)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = bench(lambda: a @ b, quick)
    mm = tflops(2 * 8192**3, mm_ms)
    torch.cuda.empty_cache()
    hbm = max(copy_bw, read_bw)
    rows = [
        Row("ceiling: copy", "2 x 2 GiB bf16 (read + write)", copy_ms, copy_bw, "GB/s", copy_bw / hbm, True),
        Row("ceiling: read", "sum of 2 GiB bf16", read_ms, read_bw, "GB/s", read_bw / hbm, True),
        Row("ceiling: matmul", "8192^3 bf16", mm_ms, mm, "TFLOP/s", 1.0, True),
    ]
    return hbm, mm, rows


# --- kernels -------------------------------------------------------------------------------------------


def close(got: torch.Tensor, want: torch.Tensor, tol: float = 2e-2) -> bool:
    return bool(not torch.isnan(got).any() and torch.allclose(got.float(), want.float(), atol=tol, rtol=tol))


def decode_rows(hbm: float, quick: bool) -> list[Row]:
    from sonar.kernels.triton import decode_attention as da
    from tests_gpu.cases import LLAMA_8B, QWEN3_06B, paged_batch, reference_attention

    rows: list[Row] = []
    cases = [
        ("decode attention", LLAMA_8B, 64, 4096, torch.bfloat16, None, True),
        ("decode attention", QWEN3_06B, 64, 4096, torch.bfloat16, None, False),
        ("decode attention fp8 KV", LLAMA_8B, 64, 4096, torch.float8_e4m3fn, None, False),
        ("decode attention", LLAMA_8B, 1, 32768, torch.bfloat16, None, False),
    ]
    for name, shape, batch, ctx, kv_dtype, splits, headline in cases:
        b = paged_batch(shape, [1] * batch, [ctx] * batch, kv_dtype=kv_dtype, spare_blocks=0, poison=False)
        chosen = splits or da.default_num_splits(batch, shape.num_kv_heads, ctx, b.query.device)

        def run() -> torch.Tensor:
            return da.paged_decode_attention(
                b.query,
                b.cache,
                b.meta.block_tables,
                b.meta.seq_lens,
                b.scale,
                ctx,
                k_scale=b.k_scale,
                v_scale=b.v_scale,
                num_splits=chosen,
            )

        ok = close(run(), reference_attention(b))
        ms = bench(run, quick)
        nbytes = da.bytes_moved(
            batch,
            ctx,
            shape.num_heads,
            shape.num_kv_heads,
            shape.head_dim,
            b.cache.element_size(),
            b.query.element_size(),
        )
        rate = gbps(nbytes, ms)
        note = f"splits={chosen}" + ("" if splits is None else " (fixed)")
        if headline:
            met = rate / hbm >= HEADLINE_TARGET
            note += f"; target >= {HEADLINE_TARGET:.0%} of HBM: {'met' if met else 'MISSED'}"
            ok = ok and met
        shape_s = f"B{batch} x {ctx} ctx, {shape.name} ({shape.num_heads}/{shape.num_kv_heads}x{shape.head_dim})"
        rows.append(Row(("* " if headline else "") + name, shape_s, ms, rate, "GB/s", rate / hbm, ok, note))
        if headline and not quick:
            rows.append(sweep_decode(b, ctx, nbytes, hbm, shape_s))
        torch.cuda.empty_cache()
    return rows


def sweep_decode(b: PagedBatch, ctx: int, nbytes: int, hbm: float, shape_s: str) -> Row:
    """Time the headline decode over tile sizes, pipeline stages and warps (at the default split
    count), then over split counts at the best of those; every config is checked against the
    reference. Prints each result and returns the best as a row, so one GPU run also says how to
    tune the defaults."""
    from sonar.kernels.triton import decode_attention as da
    from tests_gpu.cases import reference_attention

    want = reference_attention(b)
    default_splits = da.default_num_splits(b.meta.num_seqs, b.cache.shape[3], ctx, b.query.device)
    results: dict[tuple[int, int, int, int], float] = {}

    def measure(tile_n: int, stages: int, warps: int, splits: int) -> None:
        def run() -> torch.Tensor:
            return da.paged_decode_attention(
                b.query,
                b.cache,
                b.meta.block_tables,
                b.meta.seq_lens,
                b.scale,
                ctx,
                num_splits=splits,
                tile_n=tile_n,
                num_warps=warps,
                num_stages=stages,
            )

        config = f"tile_n={tile_n} stages={stages} warps={warps} splits={splits}"
        try:
            if not close(run(), want):
                print(f"  {config}: WRONG RESULT", flush=True)
                return
            ms = bench(run, True)
        except Exception as e:  # e.g. out of shared memory: report it, go on
            print(f"  {config}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            return
        results[(tile_n, stages, warps, splits)] = ms
        print(f"  {config}: {ms:.4f} ms, {gbps(nbytes, ms):,.0f} GB/s", flush=True)

    print("decode sweep:", flush=True)
    for tile_n in (32, 64, 128):
        for stages in (2, 3):
            for warps in (4, 8):
                measure(tile_n, stages, warps, default_splits)
    if results:
        tile_n, stages, warps, _ = min(results, key=results.get)
        for splits in (1, 2, 4, 8):
            if (tile_n, stages, warps, splits) not in results:
                measure(tile_n, stages, warps, splits)
    if not results:
        return Row("decode attention sweep", shape_s, None, None, "", None, False, "no config ran")
    best = min(results, key=results.get)
    ms = results[best]
    rate = gbps(nbytes, ms)
    note = "tile_n={} stages={} warps={} splits={}".format(*best)
    return Row("decode attention, best of sweep", shape_s, ms, rate, "GB/s", rate / hbm, True, note)


def prefill_rows(peak: float, quick: bool) -> list[Row]:
    from sonar.kernels.triton import prefill_attention as pa
    from tests_gpu.cases import LLAMA_8B, paged_batch, reference_attention

    rows = []
    for label, q_lens, s_lens in (
        ("4 x 2048 prompt", [2048] * 4, [2048] * 4),
        ("8 x 512 chunk over 3584 prefix", [512] * 8, [4096] * 8),
    ):
        b = paged_batch(LLAMA_8B, q_lens, s_lens, spare_blocks=0, poison=False)

        def run() -> torch.Tensor:
            return pa.paged_prefill_attention(
                b.query,
                b.cache,
                b.meta.query_start_loc,
                b.meta.seq_lens,
                b.meta.block_tables,
                b.scale,
                b.meta.max_query_len,
            )

        ok = close(run(), reference_attention(b))
        ms = bench(run, quick)
        rate = tflops(pa.flops(q_lens, s_lens, LLAMA_8B.num_heads, LLAMA_8B.head_dim), ms)
        rows.append(
            Row("prefill attention", f"{label}, llama-3-8b", ms, rate, "TFLOP/s", rate / peak, ok, "causal FLOPs")
        )
        torch.cuda.empty_cache()
    return rows


def elementwise_rows(hbm: float, quick: bool) -> list[Row]:
    from sonar.kernels import reference
    from sonar.kernels.triton import copy_blocks, rms_norm, silu_and_mul, write_kv_cache

    rows = []
    n, bf16 = 16384, torch.bfloat16

    # KV cache write, bf16 and fp8 (per-head scales)
    for kv_dtype, label in ((bf16, "bf16"), (torch.float8_e4m3fn, "fp8 per-head")):
        key = torch.randn(n, 8, 128, device="cuda", dtype=bf16)
        value = torch.randn_like(key)
        slots = torch.randperm(2048 * 16, device="cuda")[:n]
        cache = torch.zeros(2, 2048, 16, 8, 128, device="cuda", dtype=kv_dtype)
        want = cache.clone()
        ks = vs = None
        if kv_dtype == torch.float8_e4m3fn:
            ks, vs = reference.kv_scales(key, value, per_head=True)
        write_kv_cache(key, value, cache, slots, ks, vs)
        reference.write_kv_cache(key, value, want, slots, ks, vs)
        ok = close(cache.float(), want.float(), 0.13)  # one e4m3 step where GPU division rounds differently
        ms = bench(lambda: write_kv_cache(key, value, cache, slots, ks, vs), quick)
        nbytes = 2 * key.nbytes + 2 * n * 8 * 128 * cache.element_size() + slots.nbytes
        rate = gbps(nbytes, ms)
        rows.append(Row(f"kv cache write {label}", f"{n} tok x 8 x 128", ms, rate, "GB/s", rate / hbm, ok))

    # RMSNorm with the fused residual add
    x = torch.randn(n, 4096, device="cuda", dtype=bf16)
    res = torch.randn_like(x)
    w = torch.randn(4096, device="cuda", dtype=bf16)
    want, want_res = reference.rms_norm(x, w, 1e-6, res)
    got, got_res = rms_norm(x, w, 1e-6, res.clone())
    ok = close(got, want) and close(got_res, want_res)
    scratch = res.clone()
    ms = bench(lambda: rms_norm(x, w, 1e-6, scratch), quick)
    rate = gbps(4 * x.nbytes + w.nbytes, ms)
    rows.append(Row("rms norm + residual", f"{n} x 4096", ms, rate, "GB/s", rate / hbm, ok))

    # SiLU-and-mul, Llama-3-8B MLP
    x = torch.randn(n, 2 * 14336, device="cuda", dtype=bf16)
    ok = close(silu_and_mul(x), reference.silu_and_mul(x.float()))
    ms = bench(lambda: silu_and_mul(x), quick)
    rate = gbps(1.5 * x.nbytes, ms)
    rows.append(Row("silu and mul", f"{n} x 2x14336", ms, rate, "GB/s", rate / hbm, ok))

    # block copy between two GPU caches
    src = torch.randn(2, 8192, 16, 8, 128, device="cuda", dtype=bf16)
    dst = torch.zeros(2, 4096, 16, 8, 128, device="cuda", dtype=bf16)
    sid = torch.randperm(8192, device="cuda")[:2048]
    did = torch.randperm(4096, device="cuda")[:2048]
    copy_blocks(src, dst, sid, did)
    ok = bool(torch.equal(dst[:, did], src[:, sid]))
    ms = bench(lambda: copy_blocks(src, dst, sid, did), quick)
    rate = gbps(2 * 2 * 2048 * src[0, 0].nbytes, ms)
    rows.append(Row("block copy gpu->gpu", "2048 blocks of 16 x 8 x 128", ms, rate, "GB/s", rate / hbm, ok))
    torch.cuda.empty_cache()
    return rows


def junit_row(path: str) -> Row:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        return Row("tests_gpu (pytest)", "-", None, None, "", None, False, f"no results: {e}")
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = sum(int(s.get("tests", 0)) for s in suites)
    failed = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    seconds = sum(float(s.get("time", 0)) for s in suites)
    passed = total - failed - skipped
    note = f"{passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else "")
    return Row(
        "tests_gpu (pytest)",
        f"{total} tests",
        seconds * 1e3,
        None,
        "",
        None,
        failed == 0 and skipped == 0 and total > 0,
        note,
    )


# --- output --------------------------------------------------------------------------------------------


def table(rows: list[Row]) -> str:
    head = ("kernel", "shape", "time", "achieved", "% ceiling", "check", "note")
    body = []
    for r in rows:
        t = "-" if r.ms is None else (f"{r.ms:.3f} ms" if r.ms < 1e3 else f"{r.ms / 1e3:.1f} s")
        rate = "-" if r.rate is None else (f"{r.rate:,.0f} {r.unit}" if r.unit == "GB/s" else f"{r.rate:.1f} {r.unit}")
        pct = "-" if r.pct is None else f"{r.pct:.0%}"
        body.append((r.kernel, r.shape, t, rate, pct, "pass" if r.ok else "FAIL", r.note))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, body)])


def markdown(rows: list[Row], header: str) -> str:
    out = [
        header,
        "",
        "| kernel | shape | time (ms) | achieved | % of ceiling | check | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rate = "" if r.rate is None else f"{r.rate:,.1f} {r.unit}"
        pct = "" if r.pct is None else f"{r.pct:.0%}"
        ms = "" if r.ms is None else f"{r.ms:.3f}"
        out.append(f"| {r.kernel} | {r.shape} | {ms} | {rate} | {pct} | {'pass' if r.ok else 'FAIL'} | {r.note} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Sonar kernel benchmark (GPU)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--markdown", help="write a Markdown table here (for BENCHMARKS.md)")
    parser.add_argument("--junit", help="JUnit XML of a tests_gpu pytest run, reported as a row")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and variants")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA device", file=sys.stderr)
        return 2
    import triton

    props = torch.cuda.get_device_properties(0)
    header = (
        f"{props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB; "
        f"torch {torch.__version__}, triton {triton.__version__}"
    )
    print(header, flush=True)
    start = time.perf_counter()
    rows: list[Row] = []
    hbm = peak = 0.0
    for name in ("ceilings", "decode", "prefill", "elementwise", "model decode"):
        t0 = time.perf_counter()
        try:
            if name == "ceilings":
                hbm, peak, new = measure_ceilings(args.quick)
            elif name == "decode":
                new = decode_rows(hbm, args.quick)
            elif name == "prefill":
                new = prefill_rows(peak, args.quick)
            elif name == "model decode":
                import tempfile
                from pathlib import Path

                from tests_gpu.bench_decode import model_decode_rows

                with tempfile.TemporaryDirectory() as tmp:
                    new = [Row(**r) for r in model_decode_rows(hbm, args.quick, Path(tmp))]
            else:
                new = elementwise_rows(hbm, args.quick)
        except Exception as e:  # a broken section is a failed row, the others still run
            if name == "ceilings":
                raise
            new = [Row(name, "-", None, None, "", None, False, f"{type(e).__name__}: {str(e)[:200]}")]
            torch.cuda.empty_cache()
        rows += new
        print(f"[{name}: {time.perf_counter() - t0:.1f}s]", flush=True)
    if args.junit:
        rows.append(junit_row(args.junit))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": header, "rows": [asdict(r) for r in rows]}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(rows, header))
    print(f"\nkernel benchmark ({time.perf_counter() - start:.0f}s), {header}")
    print(table(rows), flush=True)
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
