"""Quantized linear layers on the GPU (`sonar.kernels.quant_triton`): the Triton W4A16 / W8A16 /
FP8 kernels at Qwen3-0.6B's shapes against `sonar.kernels.quant.reference_linear` (float32 on
CUDA), ``torch._scaled_mm`` FP8 against its dequantized reference, the layers under CUDA-graph
capture; and, run as a module, the decode-step benchmark of the same model's linear layers.

Tolerances: the Triton kernels multiply exact operands (every int4, int8 and e4m3 value is a
bf16 and an fp16 number) into float32, so with bf16 or fp16 activations they differ from the
reference by the output's final rounding (about one bf16 step: 8e-3 relative, 1e-3 of the
output's scale near zero), with float32 activations by float32 summation order (1e-5).
``torch._scaled_mm`` quantizes the activations per token to e4m3 (3 mantissa bits: up to 2**-4
relative per element, about 2.6 % RMS on Gaussian activations), so it is held to 1e-2 against
the reference fed the same quantized activations and to a 4 % relative error norm against the
unquantized one.

    python -m tests_gpu.test_quant_gpu [--markdown PATH] [--quick]

prints, per format (int4 g128, int8 and FP8 per channel, FP8 g128 through Triton, bf16), the
time of a batch-1 decode step through the linear layers of a Qwen3-0.6B-shaped model (28 layers
of qkv, o, gate_up and down, and the tied LM head: every weight read once), eager and replayed
from a CUDA graph, against the weight-read floor (weight bytes / the bandwidth of a large
device-to-device copy); then a sweep of the K split count of the int4 decode GEMV at each shape.
Exit status 1 if a layer's output disagrees with the reference.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret (also when run as a module)

import pytest  # noqa: E402
import torch  # noqa: E402

from sonar.kernels import quant  # noqa: E402
from sonar.kernels.quant import QuantizedWeight  # noqa: E402
from sonar.kernels.quant_linear import QuantLinear, backend_for  # noqa: E402
from sonar.kernels.quant_triton import TritonBackend, scaled_mm_supported  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB, LAYERS = 1024, 16, 8, 128, 3072, 151936, 28
#: (name, out_features, in_features) of one Qwen3-0.6B decoder layer's linear layers.
LAYER_SHAPES = [
    ("qkv", (HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
    ("o", HIDDEN, HEADS * HEAD_DIM),
    ("gate_up", 2 * INTERMEDIATE, HIDDEN),
    ("down", HIDDEN, INTERMEDIATE),
]
LM_HEAD = ("lm_head", VOCAB, HIDDEN)
SCALED_MM_RMS_TOL = 0.04


def make_weight(fmt: str, n: int, k: int, group: int, offsets: bool, perm: bool = False) -> QuantizedWeight:
    """Random values over the format's range, positive scales, zero points about mid-range."""
    dev = "cuda"
    groups = k // group
    if fmt == "int4":
        values = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=dev)
        scales = 0.002 + 0.004 * torch.rand(n, groups, device=dev)
    elif fmt == "int8":
        values = torch.randint(-128, 128, (n, k), dtype=torch.int8, device=dev)
        scales = 0.0001 + 0.0002 * torch.rand(n, groups, device=dev)
    else:
        values = (torch.randn(n, k, device=dev) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        scales = 0.0002 + 0.0004 * torch.rand(n, groups, device=dev)
    offs = -scales * (7 + torch.rand(n, groups, device=dev)) if offsets else None
    order = torch.randperm(k, device=dev) if perm else None
    return QuantizedWeight(fmt, values, scales, offs, group, order)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert not torch.isnan(got).any()
    scale = want.float().abs().max().item()
    fp32 = want.dtype == torch.float32
    torch.testing.assert_close(
        got.float(), want.float(), rtol=1e-5 if fp32 else 8e-3, atol=(1e-5 if fp32 else 1e-3) * scale
    )


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


# --- the Triton GEMM at real shapes -------------------------------------------------------------------


CASES = [  # (format, group, offsets, act-order): AWQ, GPTQ with act-order, int8 and FP8 per channel, FP8 blocks
    ("int4", 128, True, False),
    ("int4", 32, True, True),
    ("int8", 0, False, False),
    ("fp8", 128, False, False),
]


@pytest.mark.parametrize(("fmt", "group", "offsets", "perm"), CASES, ids=lambda v: str(v))
@pytest.mark.parametrize(("name", "n", "k"), [LAYER_SHAPES[0], LAYER_SHAPES[3]], ids=["qkv", "down"])
def test_triton_gemm_at_model_shapes(
    fmt: str, group: int, offsets: bool, perm: bool, name: str, n: int, k: int
) -> None:
    qw = make_weight(fmt, n, k, group or k, offsets, perm)
    layer = QuantLinear(qw, None)
    assert layer.backend.name == "triton" and "qweight" in layer.packed
    for m in (1, 16, 200):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        close(layer(x), quant.reference_linear(x, qw))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_triton_gemm_other_activation_dtypes(dtype: torch.dtype) -> None:
    qw = make_weight("int4", 6144, 1024, 64, True)
    bias = torch.randn(6144, device="cuda", dtype=dtype)
    layer = QuantLinear(qw, bias)
    for m in (3, 77):
        x = torch.randn(m, 1024, device="cuda", dtype=dtype)
        close(layer(x), quant.reference_linear(x, qw, bias))


def test_fp8_per_channel_through_triton_too() -> None:
    """The fallback of GPUs without FP8 matmuls: per-channel FP8 in the Triton kernel."""
    from sonar.kernels.triton.quant_matmul import quant_matmul

    qw = make_weight("fp8", 1024, 3072, 3072, False)
    for m in (1, 40):
        x = torch.randn(m, 3072, device="cuda", dtype=torch.bfloat16)
        got = quant_matmul(
            x, qw.values.view(torch.uint8).t().contiguous(), qw.scales.t().contiguous(), None, "fp8", 3072
        )
        close(got, quant.reference_linear(x, qw))


def test_which_backend_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    qw = make_weight("int4", 256, 512, 128, True)
    assert isinstance(backend_for(qw), TritonBackend)
    assert not TritonBackend().serves(make_weight("int4", 256, 512, 8, True))  # groups of 8: the reference's
    monkeypatch.setenv("SONAR_USE_TRITON", "0")
    assert not isinstance(backend_for(qw), TritonBackend)


# --- FP8 through torch._scaled_mm ------------------------------------------------------------------------


def test_quantize_rows_fp8_is_torchs_rounding() -> None:
    """Needs compute capability 8.9+ (Triton's float8 type), as the path that uses it."""
    from sonar.kernels.triton.quant_matmul import quantize_rows_fp8

    x = torch.randn(64, 3072, device="cuda", dtype=torch.bfloat16) * torch.logspace(-3, 3, 64, device="cuda")[:, None]
    q, scale = quantize_rows_fp8(x)
    want_scale = x.float().abs().amax(dim=1, keepdim=True) / 448
    assert torch.equal(scale, want_scale)
    want = (x.float() / want_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize(("n", "k"), [(4096, 1024), (1024, 3072), (VOCAB, HIDDEN)], ids=["qkv", "down", "lm_head"])
def test_fp8_per_channel_layer(n: int, k: int) -> None:
    """Per-channel FP8 runs through torch._scaled_mm where the GPU has FP8 matmuls (compute
    capability 8.9+), else through the Triton kernel (then as exact as the other formats)."""
    from sonar.kernels.triton.quant_matmul import quantize_rows_fp8

    qw = make_weight("fp8", n, k, k, False)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    layer = QuantLinear(qw, bias)
    fp8_mm = scaled_mm_supported(torch.device("cuda"))
    assert ("fp8_weight" in layer.packed) == fp8_mm
    for m in (1, 16, 300):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        got = layer(x)
        if not fp8_mm:
            close(got, quant.reference_linear(x, qw, bias))
            continue
        q, scale = quantize_rows_fp8(x)
        same_input = quant.reference_linear(q.float() * scale, qw, bias.float()).to(torch.bfloat16)
        torch.testing.assert_close(
            got.float(), same_input.float(), rtol=1e-2, atol=1e-2 * same_input.abs().max().item()
        )
        assert relative_error(got, quant.reference_linear(x, qw, bias)) < SCALED_MM_RMS_TOL
    rows = torch.tensor([0, n - 1, 7], device="cuda")
    assert torch.equal(layer.rows(rows, torch.float32), quant.dequantize(qw)[rows])


# --- CUDA graphs ------------------------------------------------------------------------------------------


def test_layers_replay_from_a_cuda_graph() -> None:
    layers = [
        QuantLinear(make_weight("int4", 4096, 1024, 128, True), None),
        QuantLinear(make_weight("int8", 1024, 4096, 4096, False, perm=True), None),
        QuantLinear(make_weight("fp8", 1024, 1024, 1024, False), None),
    ]
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)

    def step() -> torch.Tensor:
        return layers[2](layers[1](layers[0](x)).clamp(-4, 4))

    graph, out = capture(step)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, step())


def capture(step: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile the kernels outside the capture
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


# --- decode benchmark (python -m tests_gpu.test_quant_gpu) ------------------------------------------------


FORMATS = {  # name: (format, group or 0 for per channel, offsets)
    "int4 g128 (AWQ-like)": ("int4", 128, True),
    "int8 per channel": ("int8", 0, False),
    "fp8 per channel": ("fp8", 0, False),
    "fp8 g128 (Triton)": ("fp8", 128, False),
    "bf16": ("bf16", 0, False),
}


def bench(fn: Callable[[], object], quick: bool) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10 if quick else 25, rep=40 if quick else 100, return_mode="median"))


def copy_bandwidth(quick: bool) -> float:
    """GB/s of a 2 GiB device-to-device copy (read + write)."""
    x = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x), quick)
    return 2 * (1 << 31) / (ms * 1e-3) / 1e9


def decode_layers(spec: tuple[str, int, bool], num_layers: int) -> list[torch.nn.Module]:
    fmt, group, offsets = spec
    layers: list[torch.nn.Module] = []
    for _, n, k in [s for _ in range(num_layers) for s in LAYER_SHAPES] + [LM_HEAD]:
        if fmt == "bf16":
            linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
            layers.append(linear.requires_grad_(False))
        else:
            layers.append(QuantLinear(make_weight(fmt, n, k, group or k, offsets), None))
    return layers


def weight_bytes(layers: list[torch.nn.Module]) -> int:
    return sum(m.nbytes if isinstance(m, QuantLinear) else m.weight.nbytes for m in layers)


def decode_rows(bandwidth: float, quick: bool, num_layers: int = LAYERS) -> tuple[list[dict], bool]:
    """One row per format: the step's weight bytes, floor (at `bandwidth` GB/s), eager and graph
    times; and whether every format's first layer and LM head agree with their dequantized rows."""
    rows, ok = [], True
    for name, spec in FORMATS.items():
        layers = decode_layers(spec, num_layers)
        inputs = {
            k: torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for k in (HIDDEN, HEADS * HEAD_DIM, INTERMEDIATE)
        }
        for layer in (layers[0], layers[-1]):
            if isinstance(layer, QuantLinear):
                ok &= layer_agrees(layer, inputs[layer.in_features])

        def step() -> None:
            for layer in layers:
                layer(inputs[layer.in_features])

        eager = bench(step, quick)
        graph, _ = capture(step)
        graphed = bench(graph.replay, quick)
        nbytes = weight_bytes(layers)
        first = layers[0]
        backend = "torch" if not isinstance(first, QuantLinear) else first.backend.name
        if "fp8_weight" in getattr(first, "packed", {}):
            backend = "torch._scaled_mm"
        floor = nbytes / (bandwidth * 1e9) * 1e3
        rows.append(
            dict(format=name, backend=backend, mib=nbytes / 2**20, floor_ms=floor, eager_ms=eager, graph_ms=graphed)
        )
    return rows, ok


def layer_agrees(layer: QuantLinear, x: torch.Tensor) -> bool:
    """The layer's output against ``x @ w.T`` over its own dequantized rows (float32), held to the
    tolerances of the module doc."""
    w = layer.rows(torch.arange(layer.out_features, device="cuda"), torch.float32)
    want = x.float() @ w.T
    got = layer(x)
    if torch.isnan(got).any():
        return False
    if "fp8_weight" in layer.packed:
        return relative_error(got, want) < SCALED_MM_RMS_TOL
    want = want.to(got.dtype)
    scale = want.float().abs().max().item()
    return bool(torch.allclose(got.float(), want.float(), rtol=8e-3, atol=1e-3 * scale))


def split_sweep(quick: bool) -> list[dict]:
    """The int4 g128 decode GEMV (M = 1) at each shape with every valid K split count (the
    chosen one marked): what tunes `choose_tiles`."""
    from sonar.kernels.triton import quant_matmul as qm

    rows = []
    for name, n, k in [*LAYER_SHAPES, LM_HEAD]:
        layer = QuantLinear(make_weight("int4", n, k, 128, True), None)
        p = layer.packed
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        _, _, block_k, chosen = qm.choose_tiles(1, n, k, 128, x.device)
        times = {}
        splits = 1
        while (k // block_k) % splits == 0:
            times[splits] = bench(
                lambda s=splits: qm.quant_matmul(x, p["qweight"], p["scales"], p["offsets"], "int4", 128, None, s),
                quick,
            )
            splits *= 2
        rows.append(dict(shape=f"{name} {k}->{n}", mib=layer.nbytes / 2**20, chosen=chosen, times=times))
    return rows


def tables(decode: list[dict], sweep: list[dict], header: str) -> str:
    out = [
        f"quantized decode step, Qwen3-0.6B-shaped linear layers ({LAYERS} x qkv/o/gate_up/down + tied LM head), batch 1; {header}",
        "",
        "| format | backend | weights (MiB) | floor (ms) | eager (ms) | CUDA graph (ms) | graph / floor |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in decode:
        out.append(
            f"| {r['format']} | {r['backend']} | {r['mib']:,.0f} | {r['floor_ms']:.3f} | {r['eager_ms']:.3f} | "
            f"{r['graph_ms']:.3f} | {r['graph_ms'] / r['floor_ms']:.2f}x |"
        )
    out += [
        "",
        "int4 g128 GEMV at M = 1, K split count (ms; * chosen)",
        "",
        "| shape | MiB | splits: ms |",
        "|---|---|---|",
    ]
    for r in sweep:
        cells = ", ".join(f"{s}{'*' if s == r['chosen'] else ''}: {ms:.4f}" for s, ms in r["times"].items())
        out.append(f"| {r['shape']} | {r['mib']:.1f} | {cells} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Sonar quantized decode benchmark (GPU)")
    parser.add_argument("--markdown", help="write the tables here")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("test_quant_gpu: no CUDA device", file=sys.stderr)
        return 2
    import triton

    props = torch.cuda.get_device_properties(0)
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(args.quick)
    header = (
        f"{props.name}, torch {torch.__version__}, triton {triton.__version__}; copy bandwidth {bandwidth:,.0f} GB/s"
    )
    decode, ok = decode_rows(bandwidth, args.quick)
    sweep = split_sweep(args.quick)
    text = tables(decode, sweep, header)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    print(text, flush=True)
    if not ok:
        print("test_quant_gpu: a layer disagreed with the reference", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
