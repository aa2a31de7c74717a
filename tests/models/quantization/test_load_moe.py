"""Whole quantized mixture-of-experts checkpoints through Sonar: tiny random Qwen3-MoE (a dense
layer beside a sparse one), Qwen2-MoE (a shared expert) and Mixtral (``block_sparse_moe``,
``w1`` / ``w3`` / ``w2``) checkpoints as ``save_pretrained`` writes them, one tensor per expert
and projection, whose linear layers (attention, dense MLP, shared expert, every expert) are
quantized in the test with each format's own packing (`tests.models.quantization.formats`),
the routers left plain as the published checkpoints leave them. Loaded by
`load_quantized_checkpoint`, the experts served as `QuantizedExperts`, against transformers
reading the same layers' dequantized weights.

Tolerance: as tests/models/quantization/test_load.py, both sides in float32 from the same
dequantized weights: 1e-4. Split over two gloo ranks (tensor or expert parallelism), the logits
of one rank within the same 1e-4.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from sonar.kernels.quant import dequantize
from sonar.kernels.quant_linear import QuantLinear
from sonar.models.decoder import DecoderForCausalLM
from sonar.models.errors import ModelLoadError
from sonar.models.moe import FusedExperts, QuantizedExperts, SparseMoeBlock
from sonar.models.quantization import quantize_dynamic_fp8
from tests.models import parallel_rank
from tests.models.quantization import formats as f
from tests.models.quantization.test_load import CASES, _compare, _load, _tiny, write_quantized
from tests.models.rank_pool import RankPool
from tests.models.test_gguf_moe import two_ranks
from tests.models.test_parallel import ATOL as TP_ATOL

#: The checkpoint modules the tests quantize: every projection of the layers (not the routers).
PROJECTION = re.compile(r"model\.layers\.\d+\..*(_proj|\.w[123])")
FAMILIES = {
    # a dense MLP in layer 0, the experts in layer 1
    "qwen3_moe": dict(
        model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, mlp_only_layers=[0]
    ),
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
        norm_topk_prob=False,
    ),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
}
ARCHITECTURES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
SERVED = [
    *(("qwen3_moe", case) for case in CASES),
    ("qwen2_moe", "gptq-int8-sym-v2"),
    ("qwen2_moe", "ct-w4a16"),
    ("mixtral", "gptq-int4-act-order-v1"),
    ("mixtral", "awq"),
    ("mixtral", "fp8-block"),
]


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    return {name: _tiny(tmp_path_factory, ARCHITECTURES[name], **dict(extra)) for name, extra in FAMILIES.items()}


def _qc(case: str) -> dict:
    """The case's config; compressed-tensors' ignore list names the routers, as llm-compressor's
    MoE recipes do."""
    qc = CASES[case][1]
    if qc["quant_method"] == "compressed-tensors":
        return {**qc, "ignore": [*qc["ignore"], "re:.*mlp.gate$", "re:.*shared_expert_gate$"]}
    return qc


def _write_moe(plain: Path, out: Path, case: str) -> dict[str, torch.Tensor]:
    """The plain checkpoint in `plain` written to `out` with its projections quantized as `case`
    says; returns the dequantized weights by checkpoint name."""
    quantize, _, with_lm_head = CASES[case]
    state = load_file(str(plain / "model.safetensors"))
    modules = [n.removesuffix(".weight") for n in state if PROJECTION.fullmatch(n.removesuffix(".weight"))]
    modules += ["lm_head"] if with_lm_head and "lm_head.weight" in state else []
    config = json.loads((plain / "config.json").read_text())
    return write_quantized(state, config, modules, out, quantize, _qc(case))


def _reference(plain: Path, dequantized: dict[str, torch.Tensor], out: Path) -> Any:
    """transformers reading the plain checkpoint with the dequantized weights in place of the
    quantized layers' (its own loader stacks the experts)."""
    from transformers import AutoModelForCausalLM

    out.mkdir()
    save_file({**load_file(str(plain / "model.safetensors")), **dequantized}, str(out / "model.safetensors"))
    (out / "config.json").write_text((plain / "config.json").read_text())
    return AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()


def _blocks(model: DecoderForCausalLM) -> list[SparseMoeBlock]:
    return [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]


def _assert_quantized_experts(model: DecoderForCausalLM) -> None:
    """Every sparse block's experts are quantized layers, none dequantized into a dense stack."""
    blocks = _blocks(model)
    assert blocks
    for block in blocks:
        assert isinstance(block.experts, QuantizedExperts)
        assert len(block.experts) == block.spec.num_experts
        assert all(
            isinstance(e.gate_up_proj, QuantLinear) and isinstance(e.down_proj, QuantLinear) for e in block.experts
        )


@pytest.mark.parametrize("family, case", SERVED)
def test_logits_equal_transformers_on_the_dequantized_weights(
    family: str, case: str, tiny_moe: dict[str, tuple[Any, Path]], tmp_path: Path
) -> None:
    _, plain = tiny_moe[family]
    dequantized = _write_moe(plain, tmp_path / "quantized", case)
    model = _load(tmp_path / "quantized")
    _assert_quantized_experts(model)
    quantized = {name for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert "model.layers.0.self_attn.qkv_proj" in quantized
    if family == "qwen3_moe":
        assert "model.layers.0.mlp.gate_up_proj" in quantized  # the dense layer
    if family == "qwen2_moe":
        assert "model.layers.0.mlp.shared_expert.gate_up_proj" in quantized
    assert not any(isinstance(block.gate, QuantLinear) for block in _blocks(model))
    _compare(model, _reference(plain, dequantized, tmp_path / "reference"))
    # one grouped native call per block (sonar_cpu::moe_quant), but for act-order's permutations
    act_order = CASES[case][1].get("desc_act", False)
    assert all(block.experts.is_stacked != act_order for block in _blocks(model))


def test_dequantize_weights_serves_the_experts_unquantized(
    tiny_moe: dict[str, tuple[Any, Path]], tmp_path: Path
) -> None:
    """``--dequantize-weights`` on a quantized MoE checkpoint: the dense experts' path, the same logits."""
    _, plain = tiny_moe["mixtral"]
    dequantized = _write_moe(plain, tmp_path / "quantized", "gptq-int4-act-order-v1")
    model = _load(tmp_path / "quantized", dequantize_weights=True)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    assert all(isinstance(block.experts, FusedExperts) for block in _blocks(model))
    _compare(model, _reference(plain, dequantized, tmp_path / "reference"))


def test_load_model_serves_the_experts_quantized(tiny_moe: dict[str, tuple[Any, Path]], tmp_path: Path) -> None:
    """Through `load_model` (what `sonar serve` calls): the method from config.json, one int4
    layer per expert and projection."""
    from sonar.models.loader import load_model

    hf, plain = tiny_moe["qwen2_moe"]
    _write_moe(plain, tmp_path, "awq")
    loaded = load_model(str(tmp_path), dtype="float32")
    assert loaded.quantization == "awq"
    _assert_quantized_experts(loaded.model)
    layers, experts = hf.config.num_hidden_layers, hf.config.num_experts
    # per layer: qkv, o, the shared expert's gate_up and down, each expert's gate_up and down
    assert loaded.quantized.formats == {"int4": layers * (4 + 2 * experts)}


def test_dynamic_fp8_of_a_plain_checkpoint(tiny_moe: dict[str, tuple[Any, Path]], tmp_path: Path) -> None:
    """``--quantization fp8`` on an unquantized MoE checkpoint: the experts too, per output row."""
    _, plain = tiny_moe["qwen3_moe"]
    model = _load(plain, "fp8")
    _assert_quantized_experts(model)
    assert model.model.layers[1].mlp.experts[0].down_proj.meta.format == "fp8"
    state = load_file(str(plain / "model.safetensors"))
    dequantized = {
        name: dequantize(quantize_dynamic_fp8(w))
        for name, w in state.items()
        if PROJECTION.fullmatch(name.removesuffix(".weight"))
    }
    _compare(model, _reference(plain, dequantized, tmp_path / "reference"))


def test_dynamic_fp8_of_stacked_experts_is_refused(tiny_moe: dict[str, tuple[Any, Path]], tmp_path: Path) -> None:
    """Experts stacked as transformers holds them (``mlp.experts.gate_up_proj`` ``[E, 2 I, h]``)
    are not quantized at load, and not left unquantized silently either."""
    hf, plain = tiny_moe["qwen3_moe"]
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((plain / "config.json").read_text())
    with pytest.raises(
        ModelLoadError, match=r"not model\.layers\.1\.mlp\.experts's stacked down_proj and gate_up_proj"
    ):
        _load(tmp_path, "fp8")


def test_a_quantized_router_is_refused(tiny_moe: dict[str, tuple[Any, Path]], tmp_path: Path) -> None:
    """The router is read as a plain matrix (its float32 softmax picks the experts): stored
    quantized, it is refused by name."""
    _, plain = tiny_moe["qwen3_moe"]
    _write_moe(plain, tmp_path, "fp8-block")
    state = load_file(str(tmp_path / "model.safetensors"))
    tensors, _ = f.fp8_block(state.pop("model.layers.1.mlp.gate.weight"), (128, 128))
    state.update({f"model.layers.1.mlp.gate.{part}": t for part, t in tensors.items()})
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ModelLoadError, match=r"model\.layers\.1\.mlp\.gate is stored quantized; Sonar serves quantized linear"
    ):
        _load(tmp_path)


@pytest.mark.parametrize("mode", ["tensor", "expert"])
def test_two_ranks_give_the_logits_of_one(
    tiny_moe: dict[str, tuple[Any, Path]], mode: str, rank_pool: RankPool, tmp_path: Path
) -> None:
    """Real two-rank gloo groups (`parallel_rank`, `ep_rank`) serving the quantized checkpoints in
    float32: each rank its slice of every expert or its own experts whole, the logits of one rank
    within tests/models/test_parallel.py's 1e-4 (the same products, summed in another order)."""
    sources = []
    for family, case in (("qwen3_moe", "ct-w4a16"), ("mixtral", "gptq-int8-sym-v2")):  # groups whole per rank
        _write_moe(tiny_moe[family][1], tmp_path / family, case)
        sources.append(str(tmp_path / family))
    got = two_ranks(rank_pool, mode, "linear", sources, tmp_path / "logits.pt")
    parallel_rank.assert_ranks_give_one(sources, got, TP_ATOL, mode, same_argmax=True)


def test_the_weight_filter_leaves_other_ranks_quantized_experts_unread(
    tiny_moe: dict[str, tuple[Any, Path]], tmp_path: Path
) -> None:
    """``--enable-ep-weight-filter``: rank 1 of two (``linear``: experts 2 and 3) never reads
    experts 0 and 1, so a part missing there fails the load without the filter and not with it;
    the rank's experts are those of the whole checkpoint."""
    from sonar.models.loader import load_model
    from sonar.models.parallel import TensorParallel

    _write_moe(tiny_moe["mixtral"][1], tmp_path, "gptq-int8-sym-v2")
    whole = _blocks(load_model(str(tmp_path), dtype="float32").model)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.0.block_sparse_moe.experts.0.w2.qzeros"]
    save_file(state, str(tmp_path / "model.safetensors"))
    rank = dict(dtype="float32", parallel=TensorParallel(1, 2), expert_placement="linear")
    with pytest.raises(ModelLoadError, match=r"experts\.0\.w2 lacks its qzeros"):
        load_model(str(tmp_path), **rank)
    filtered = _blocks(load_model(str(tmp_path), ep_weight_filter=True, **rank).model)
    for full, mine in zip(whole, filtered):
        assert mine.local_experts == [2, 3] and len(mine.experts) == 2
        for i, e in enumerate(mine.local_experts):
            for proj in ("gate_up_proj", "down_proj"):
                want, got = getattr(full.experts[e], proj), getattr(mine.experts[i], proj)
                assert torch.equal(got.packed["packed"], want.packed["packed"]), (e, proj)
