"""GPT-OSS on the GPU: the Triton attention kernels with sinks at GPT-OSS-20B's attention shapes
(64 query heads over 8 KV heads of 64, a 128-token window on half the layers) against the float32
torch reference, the fused MoE operator's GPT-OSS option (expert biases, clamped SwiGLU) at its
expert shapes against the per-expert reference and in a CUDA graph, and a tiny GPT-OSS through the
whole engine on CUDA (eager, CUDA graphs, and -O2's torch.compile + graphs) giving the CPU path's
greedy tokens, float32, with dense experts and with MXFP4 ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import sonar
from sonar.kernels import moe, reference
from sonar.kernels.triton import fused_moe, paged_attention, paged_decode_attention
from tests.engine.conftest import save_word_tokenizer
from tests.models.test_gpt_oss import _hf, tiny_config
from tests_gpu.cases import AttnShape, PagedBatch, paged_batch

GPT_OSS_20B = AttnShape("gpt-oss-20b", 64, 8, 64)
WINDOW = 128
TOL = 2e-2


def _sinks() -> torch.Tensor:
    return (torch.randn(GPT_OSS_20B.num_heads, device="cuda") * 2 + 1).to(torch.bfloat16)


def _reference(batch: PagedBatch, window: int | None, sinks: torch.Tensor) -> torch.Tensor:
    return reference.paged_attention(
        batch.query.float(), batch.cache.float(), batch.meta, batch.scale, window, sinks=sinks.float()
    )


@pytest.mark.parametrize("window", [None, WINDOW])
@pytest.mark.parametrize("num_splits", [None, 1, 8])
def test_sinks_decode_gpt_oss_shapes(num_splits: int | None, window: int | None) -> None:
    seq_lens = torch.randint(1, 2049, (32,)).tolist()
    b = paged_batch(GPT_OSS_20B, [1] * 32, seq_lens)
    sinks = _sinks()
    got = paged_decode_attention(
        b.query,
        b.cache,
        b.meta.block_tables,
        b.meta.seq_lens,
        b.scale,
        b.meta.max_seq_len,
        window,
        num_splits=num_splits,
        sinks=sinks,
    )
    want = _reference(b, window, sinks)
    torch.testing.assert_close(got.float(), want, atol=TOL, rtol=TOL)
    plain = reference.paged_attention(b.query.float(), b.cache.float(), b.meta, b.scale, window)
    assert (want - plain).abs().max() > 0.05


@pytest.mark.parametrize("window", [None, WINDOW])
def test_sinks_mixed_batch_gpt_oss_shapes(window: int | None) -> None:
    b = paged_batch(GPT_OSS_20B, [1, 300, 1, 77], [900, 300, 1500, 1100])
    sinks = _sinks()
    got = paged_attention(b.query, b.cache, b.meta, b.scale, window, sinks=sinks)
    torch.testing.assert_close(got.float(), _reference(b, window, sinks), atol=TOL, rtol=TOL)


MOE_SHAPES = {  # tokens, hidden, experts, intermediate, top-k (GPT-OSS-20B: 32 experts of 2880, top-4)
    "gpt_oss_20b_decode": (8, 2880, 32, 2880, 4),
    "gpt_oss_20b_prefill": (512, 2880, 32, 2880, 4),
}


def _moe_case(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    n, h, experts, inter, top_k = shape
    x = torch.randn(n, h, device="cuda").to(dtype)
    w13 = (torch.randn(experts, 2 * inter, h, device="cuda") * 4 / h**0.5).to(dtype)
    b13 = torch.randn(experts, 2 * inter, device="cuda").to(dtype)
    w2 = (torch.randn(experts, h, inter, device="cuda") / inter**0.5).to(dtype)
    b2 = torch.randn(experts, h, device="cuda").to(dtype)
    weights, ids = moe.route_topk_softmax(torch.randn(n, experts, device="cuda"), top_k)
    return x, weights, ids, w13, w2, b13, b2


def _moe_reference(args: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """float32 on the same (rounded) values: the kernel rounds gate/up and the activation once."""
    floats = tuple(t if t.dtype == torch.int64 else t.float() for t in args)
    return moe.fused_experts_reference(*floats, swiglu_limit=7.0, swiglu_alpha=1.702)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", list(MOE_SHAPES))
def test_swiglu_experts_match_the_reference(shape: str, dtype: torch.dtype) -> None:
    args = _moe_case(MOE_SHAPES[shape], dtype)
    got = moe.fused_experts(*args, 7.0, 1.702)  # dispatches to Triton for CUDA tensors
    want = _moe_reference(args)
    atol = 2e-3 if dtype == torch.float32 else 1e-2 * want.abs().max().item()
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=3e-2)


def test_swiglu_experts_in_a_cuda_graph_replay_new_routing() -> None:
    args = _moe_case(MOE_SHAPES["gpt_oss_20b_decode"], torch.bfloat16)
    x, weights, ids, w13, w2, b13, b2 = args
    fused_moe.fused_experts(*args, 7.0, 1.702)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe.fused_experts(*args, 7.0, 1.702)
    new_weights, new_ids = moe.route_topk_softmax(torch.randn(ids.shape[0], w13.shape[0], device="cuda"), 4)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    want = _moe_reference(args)
    torch.testing.assert_close(out.float(), want, atol=1e-2 * want.abs().max().item(), rtol=3e-2)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _greedy(monkeypatch: pytest.MonkeyPatch, path: Path, device: str, **engine_args) -> list[list[int]]:
    monkeypatch.setenv("SONAR_DEVICE", device)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 384, (n,), generator=gen).tolist() for n in (40, 3, 64, 17)]
    params = sonar.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    async with sonar.open(str(path), dtype="float32", num_gpu_blocks_override=64, **engine_args) as llm:
        return [out.token_ids for out in await llm.generate_many(prompts, params)]


@pytest.mark.anyio
async def test_tiny_gpt_oss_on_gpu_equals_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _hf(tiny_config(), seed=21).save_pretrained(str(tmp_path))
    save_word_tokenizer(tmp_path, 384)
    cpu = await _greedy(monkeypatch, tmp_path, "cpu", enforce_eager=True)
    eager = await _greedy(monkeypatch, tmp_path, "cuda", enforce_eager=True)
    graphs = await _greedy(monkeypatch, tmp_path, "cuda", cudagraph_capture_sizes=[1, 2, 4], optimization_level=1)
    compiled = await _greedy(monkeypatch, tmp_path, "cuda", cudagraph_capture_sizes=[1, 2, 4])
    assert eager == cpu
    assert graphs == cpu
    assert compiled == cpu


@pytest.mark.anyio
async def test_mxfp4_checkpoint_on_gpu_serves_the_experts_quantized(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A published-layout MXFP4 checkpoint on CUDA: the experts stay MXFP4 on the Triton backend
    (its grouped GEMM), and the engine gives the CPU's quantized greedy tokens eagerly and in CUDA
    graphs; ``--dequantize-weights`` gives them too."""
    from sonar.models.loader import load_model
    from sonar.models.moe import quantized_experts
    from tests.models.quantization.test_mxfp4 import write_mxfp4_checkpoint

    write_mxfp4_checkpoint(tmp_path)
    loaded = load_model(str(tmp_path), dtype="float32", device="cuda")
    blocks = quantized_experts(loaded.model)
    assert blocks and all(e.gate_up_proj.backend.name == "triton" for b in blocks for e in b)
    cpu = await _greedy(monkeypatch, tmp_path, "cpu", enforce_eager=True)
    eager = await _greedy(monkeypatch, tmp_path, "cuda", enforce_eager=True)
    graphs = await _greedy(monkeypatch, tmp_path, "cuda", cudagraph_capture_sizes=[1, 2, 4], optimization_level=1)
    dequantized = await _greedy(monkeypatch, tmp_path, "cuda", enforce_eager=True, dequantize_weights=True)
    assert eager == cpu
    assert graphs == cpu
    assert dequantized == cpu
