"""GGUF mixture-of-experts files served with their experts quantized (`QuantizedExperts`): tiny
Mixtral / Qwen2-MoE / Qwen3-MoE models written by `tests.models.gguf_writer` in Q8_0 and Q4_0.

- exactness, float32: the quantized experts on the torch reference backend equal transformers on
  the dequantized weights (greedy tokens, logits within 1e-4), so the grouping by expert and the
  weighted sum are the fused operator's;
- as served (bfloat16, the native kernels): the experts' loaded bytes are the quants' (not
  bfloat16's), and every prompt token's logits lie within `QUANT_TOLERANCE` of the same file
  served with ``--dequantize-weights``, at 90 % of the positions at least: the int8 kernels
  quantize the activations, which can flip a router's near-tied top-k choice at a token (the
  tiny models have ties within 0.01 of probability), and that token's logits then move by more.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sonar.models.errors import ModelLoadError
from sonar.models.gguf_file import gguf_quantized_weights
from sonar.models.loader import load_model
from sonar.models.moe import QuantizedExperts, SparseMoeBlock
from sonar.models.quantized import install_quantized
from tests.conftest import fresh_cache_root
from tests.engine.conftest import spread_weights
from tests.models import parallel_rank
from tests.models.against import assert_greedy_equals_transformers
from tests.models.driver import GreedyDriver
from tests.models.gguf_writer import write_gguf
from tests.models.rank_pool import RankPool
from tests.models.test_expert_parallel import _group_logits as ep_group_logits
from tests.models.test_gguf_families import _configs, _prompts, _reference
from tests.models.test_parallel import _group_logits as tp_group_logits

MOE = ("mixtral", "qwen2_moe", "qwen3_moe")
QUANT_TOLERANCE = 0.05
"""Against the dequantized bfloat16 serve: a fraction of the largest logit."""
SPLIT_ATOL = 1e-4
"""Two ranks against one, float32 logits O(1): the same products, summed in another order
(`tests/models/test_parallel.py`'s bound)."""


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SONAR_CACHE_ROOT", str(fresh_cache_root(tmp_path / "cache")))


@pytest.fixture(scope="module")
def models() -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    configs, out = _configs(), {}
    for i, name in enumerate(MOE):
        torch.manual_seed(200 + i)
        hf = AutoModelForCausalLM.from_config(configs[name], dtype=torch.float32, attn_implementation="eager").eval()
        with torch.no_grad():
            for pname, param in hf.named_parameters():
                norm = pname.endswith("norm.weight")
                param.copy_((1.0 if norm else 0.0) + (0.2 if norm else 0.15) * torch.randn_like(param))
        out[name] = hf
    return out


def _qtype(name: str) -> Any:
    from gguf import GGMLQuantizationType

    return getattr(GGMLQuantizationType, name)


def _blocks(model: Any) -> list[SparseMoeBlock]:
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("name", MOE)
def test_quantized_experts_equal_transformers_on_the_dequantized_weights(
    name: str, qtype: str, models: dict[str, Any], tmp_path: Path
) -> None:
    hf = models[name]
    path = tmp_path / f"{name}-{qtype}.gguf"
    ref = _reference(hf, write_gguf(path, name, hf, _qtype(qtype)))
    loaded = load_model(str(path), dtype="float32", dequantize_weights=True)
    quantized, _ = gguf_quantized_weights(path, loaded.config)
    assert any(".mlp.experts.0.down_proj" in n for n in quantized)
    installed = install_quantized(loaded.model, loaded.model.shard_quantized(quantized), reference=True)
    assert all(isinstance(b.experts, QuantizedExperts) for b in _blocks(loaded.model))
    assert any(".experts.1.gate_up_proj" in n for n in installed.quantized)
    assert_greedy_equals_transformers(loaded.model, ref, _prompts(hf.config.vocab_size), 8)


@pytest.mark.parametrize(("name", "qtype", "ratio"), [("qwen3_moe", "Q8_0", 0.6), ("mixtral", "Q4_0", 0.4)])
def test_served_quantized_experts_take_the_quants_bytes_and_match_the_dequantized_serve(
    name: str, qtype: str, ratio: float, models: dict[str, Any], tmp_path: Path
) -> None:
    hf = models[name]
    path = tmp_path / f"{name}-{qtype}.gguf"
    write_gguf(path, name, hf, _qtype(qtype))
    served = load_model(str(path), dtype="bfloat16")
    dequantized = load_model(str(path), dtype="bfloat16", dequantize_weights=True)
    assert served.quantization == "gguf" and dequantized.quantization is None

    quants, _ = gguf_quantized_weights(path, served.config)
    expert_quants = sum(qw.nbytes for n, qw in quants.items() if ".mlp.experts." in n)
    blocks = _blocks(served.model)
    expert_bytes = sum(layer.nbytes for b in blocks for e in b.experts for layer in (e.gate_up_proj, e.down_proj))
    bf16_bytes = sum(
        2 * (b.experts.gate_up_proj.numel() + b.experts.down_proj.numel()) for b in _blocks(dequantized.model)
    )
    assert expert_bytes == expert_quants
    assert expert_bytes < ratio * bf16_bytes, (expert_bytes, bf16_bytes)
    assert not any(isinstance(b.experts, QuantizedExperts) for b in _blocks(dequantized.model))

    prompts = _prompts(hf.config.vocab_size)
    got = GreedyDriver(served.model, torch.bfloat16, num_blocks=64, block_size=4).generate(
        prompts, 6, prompt_logits=True
    )
    want = GreedyDriver(dequantized.model, torch.bfloat16, num_blocks=64, block_size=4).generate(
        prompts, 6, prompt_logits=True
    )
    errors = torch.cat([(a.float() - b.float()).abs().amax(-1) for a, b in zip(got.prompt_logits, want.prompt_logits)])
    scale = max(float(b.float().abs().max()) for b in want.prompt_logits)
    assert (errors < QUANT_TOLERANCE * scale).float().mean() >= 0.9, errors
    agree = sum(
        int(a.float().argmax(-1).eq(b.float().argmax(-1)).sum()) for a, b in zip(got.prompt_logits, want.prompt_logits)
    )
    assert agree >= 0.9 * errors.numel()
    assert all(b.experts.is_stacked for b in blocks), "the grouped operator (sonar_cpu::moe_quant) served them"


def test_a_block_with_some_experts_not_quantized_is_refused(models: dict[str, Any], tmp_path: Path) -> None:
    hf = models["qwen3_moe"]
    path = tmp_path / "q8.gguf"
    write_gguf(path, "qwen3_moe", hf, _qtype("Q8_0"))
    loaded = load_model(str(path), dtype="float32", dequantize_weights=True)
    quantized, _ = gguf_quantized_weights(path, loaded.config)
    del quantized["model.layers.0.mlp.experts.3.down_proj"]
    with pytest.raises(ModelLoadError, match=r"experts.3.down_proj is not.*--dequantize-weights"):
        install_quantized(loaded.model, quantized, reference=True)


def _meta_qwen3_moe(parallel: Any) -> Any:
    from sonar.models.qwen_moe import Qwen3MoeForCausalLM

    with torch.device("meta"):
        return Qwen3MoeForCausalLM(_configs()["qwen3_moe"], parallel)


def _int8(rows: int, cols: int) -> Any:
    from sonar.kernels.quant import QuantizedWeight

    return QuantizedWeight("int8", torch.zeros(rows, cols, dtype=torch.int8), torch.ones(rows, cols // 32), None, 32)


def test_a_rank_slice_across_quant_groups_is_refused() -> None:
    """Qwen3-MoE's experts of intermediate size 32 over two tensor-parallel ranks: each rank's 16
    input columns of down cut a group of 32 in two."""
    from sonar.models.parallel import TensorParallel

    model = _meta_qwen3_moe(TensorParallel(rank=0, size=2))
    with pytest.raises(ModelLoadError, match=r"experts\.0\.down_proj: a rank's 16 input columns do not fall on.*32"):
        model.shard_quantized({"model.layers.0.mlp.experts.0.down_proj": _int8(64, 32)})


def test_quantized_experts_are_refused_under_expert_load_balancing() -> None:
    """--enable-eplb moves the dense experts' stacked weights between ranks, not quantized layers."""
    from sonar.models.parallel import TensorParallel

    model = _meta_qwen3_moe(TensorParallel(rank=0, size=2, expert_placement="linear", redundant_experts=2))
    with pytest.raises(ModelLoadError, match=r"experts\.0\.gate_proj.*--enable-eplb.*--dequantize-weights"):
        model.shard_quantized({"model.layers.0.mlp.experts.0.gate_proj": _int8(32, 64)})


# -- split over two ranks -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def split_files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Q8_0 files of Qwen2-MoE (a shared expert, a dense layer), Mixtral and DeepSeek-V2 (latent
    attention, shared experts) whose every intermediate size is a multiple of 64, so each of two
    tensor-parallel ranks holds whole groups of 32 of every down projection."""
    from transformers import AutoModelForCausalLM

    from tests.models.test_gguf_deepseek import _configs as deepseek_configs

    configs, out = {**_configs(), **deepseek_configs()}, []
    configs["qwen2_moe"].update({"intermediate_size": 128, "moe_intermediate_size": 64})
    configs["mixtral"].update({"intermediate_size": 128})
    configs["deepseek_v2"].update({"intermediate_size": 128, "moe_intermediate_size": 64})
    for i, name in enumerate(("qwen2_moe", "mixtral", "deepseek_v2")):
        torch.manual_seed(300 + i)
        hf = AutoModelForCausalLM.from_config(configs[name], dtype=torch.float32).eval()
        spread_weights(hf)
        path = tmp_path_factory.mktemp(name) / f"{name}-q8_0.gguf"
        write_gguf(path, name, hf, _qtype("Q8_0"))
        out.append(str(path))
    return out


def _dense(layer: Any) -> torch.Tensor:
    return layer.rows(torch.arange(layer.out_features), torch.float32)


@pytest.mark.parametrize("placement", [None, "round_robin"], ids=["tensor", "expert"])
def test_each_rank_holds_its_part_of_the_quantized_experts(split_files: list[str], placement: str | None) -> None:
    """Tensor parallelism: every expert, this rank's rows of gate and up and columns of down;
    expert parallelism: this rank's experts whole, renumbered in the order it holds them."""
    from sonar.models.parallel import TensorParallel

    for source in split_files:
        whole = load_model(source, dtype="float32").model
        for rank in range(2):
            tp = TensorParallel(rank, 2, expert_placement=placement)
            part = load_model(source, dtype="float32", parallel=tp).model
            for full, mine in zip(_blocks(whole), _blocks(part)):
                assert isinstance(mine.experts, QuantizedExperts) and len(mine.experts) == len(mine.local_experts)
                size, inter = full.intermediate, mine.intermediate
                rows = torch.cat([torch.arange(inter), size + torch.arange(inter)]) + rank * inter
                for i, e in enumerate(mine.local_experts):
                    gate_up, down = _dense(full.experts[e].gate_up_proj), _dense(full.experts[e].down_proj)
                    if placement is None:
                        gate_up, down = gate_up[rows], down[:, rank * inter : (rank + 1) * inter]
                    assert torch.equal(_dense(mine.experts[i].gate_up_proj), gate_up), (source, rank, e)
                    assert torch.equal(_dense(mine.experts[i].down_proj), down), (source, rank, e)


@pytest.mark.parametrize("mode", ["tensor", "expert"])
def test_two_ranks_give_the_logits_of_one(
    split_files: list[str], mode: str, rank_pool: RankPool, tmp_path: Path
) -> None:
    """Real two-rank gloo groups (`parallel_rank`, `ep_rank`) serving the quants in float32: the
    logits of one rank within `SPLIT_ATOL`, the same greedy tokens."""
    got = two_ranks(rank_pool, mode, "round_robin", split_files, tmp_path / "logits.pt")
    parallel_rank.assert_ranks_give_one(split_files, got, SPLIT_ATOL, mode, same_argmax=True)


def two_ranks(pool: RankPool, mode: str, placement: str, sources: list[str], out: Path) -> list[list[torch.Tensor]]:
    """Each source's logits from two gloo ranks: tensor-parallel (`mode` "tensor") or expert-parallel
    with `placement`."""
    if mode == "tensor":
        return tp_group_logits(pool, 2, 1, sources, out)
    return ep_group_logits(pool, 2, placement, sources, out)
