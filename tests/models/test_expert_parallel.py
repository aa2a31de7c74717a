"""Expert parallelism of the MoE families (``--enable-expert-parallel``, `sonar.models.moe`): each
tensor-parallel rank holds whole experts, ``E / size`` of them (``linear``: contiguous ranges,
``round_robin``: expert ``e`` on rank ``e % size``), computes the tokens routed to them, and the
all-reduce that ends the layer sums the ranks.

Tiny random-weight Mixtral and Qwen2-MoE (a shared expert, a dense layer) checkpoints: what each
rank loads from either expert layout (and leaves unread with ``--enable-ep-weight-filter``), the logits of real two-rank gloo groups (one process per
rank, `tests/models/ep_rank.py`) against one rank, the whole engine at two ranks against
transformers, and the settings that are refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import sonar
from sonar.engine.config import EngineConfig
from sonar.models.loader import load_model
from sonar.models.moe import MoeSpec, SparseMoeBlock
from sonar.models.parallel import ParallelLayoutError, TensorParallel
from tests.engine.conftest import save_word_tokenizer, spread_weights
from tests.models import parallel_rank
from tests.models.rank_pool import RankPool
from tests.models.test_moe import _configs

NAMES = ("mixtral", "qwen2_moe")
PLACEMENTS = ("linear", "round_robin")
#: Float32 logits of the same products summed over two ranks instead of one (logits O(1)).
ATOL = 1e-5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """Each family's checkpoint as ``save_pretrained`` writes it (one tensor per expert), and
    under ``stacked`` the same weights under transformers' in-memory names (``experts.gate_up_proj``)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    configs = _configs()
    out = {}
    for i, name in enumerate(NAMES):
        torch.manual_seed(60 + i)
        hf = AutoModelForCausalLM.from_config(configs[name], dtype=torch.float32).eval()
        spread_weights(hf)
        path = tmp_path_factory.mktemp(name)
        hf.save_pretrained(str(path))
        save_word_tokenizer(path, configs[name].vocab_size)
        stacked = tmp_path_factory.mktemp(f"{name}-stacked")
        save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(stacked / "model.safetensors"))
        (stacked / "config.json").write_text((path / "config.json").read_text())
        out[name] = (path, hf)
        out[f"{name}-stacked"] = (stacked, hf)
    return out


def test_experts_are_dealt_in_ranges_or_in_turn() -> None:
    linear = [TensorParallel(r, 3, expert_placement="linear").local_experts(6) for r in range(3)]
    assert linear == [[0, 1], [2, 3], [4, 5]]
    turns = [TensorParallel(r, 3, expert_placement="round_robin").local_experts(6) for r in range(3)]
    assert turns == [[0, 3], [1, 4], [2, 5]]
    assert TensorParallel(1, 3).local_experts(6) == list(range(6))  # tensor-parallel experts: all, sliced
    ids = torch.tensor([[0, 5], [3, 2]])
    assert TensorParallel(1, 3, expert_placement="linear").local_expert_ids(ids, 6).tolist() == [[-1, -1], [1, 0]]
    assert TensorParallel(2, 3, expert_placement="round_robin").local_expert_ids(ids, 6).tolist() == [[-1, 1], [-1, 0]]


def test_experts_that_do_not_divide_fail_naming_the_count() -> None:
    spec = MoeSpec(num_experts=5, top_k=2, intermediate=8, renormalize=True)
    with torch.device("meta"), pytest.raises(ParallelLayoutError, match="number of experts \\(5\\).*multiple of 2"):
        SparseMoeBlock(16, spec, TensorParallel(0, 2, expert_placement="linear"))
    with pytest.raises(ParallelLayoutError, match="--expert-placement-strategy 'random'"):
        TensorParallel(0, 2, expert_placement="random").local_experts(4)


@pytest.mark.parametrize("layout", ["", "-stacked"], ids=["per_expert", "stacked"])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_each_rank_loads_its_experts_whole(checkpoints: dict[str, Any], placement: str, layout: str) -> None:
    """Whole experts (full intermediate size) of this rank only; the router, the shared expert and
    the dense layer as tensor parallelism loads them."""
    for name in NAMES:
        path = str(checkpoints[name + layout][0])
        whole = load_model(path, dtype="float32").model
        for rank in range(2):
            tp = TensorParallel(rank, 2)
            ep = load_model(path, dtype="float32", parallel=tp, expert_placement=placement).model
            sliced = dict(load_model(path, dtype="float32", parallel=tp).model.named_parameters())
            for i, layer in enumerate(ep.model.layers):
                if not isinstance(layer.mlp, SparseMoeBlock):
                    continue
                local = layer.mlp.local_experts
                assert local == TensorParallel(rank, 2, expert_placement=placement).local_experts(len(local) * 2)
                experts = whole.model.layers[i].mlp.experts
                assert torch.equal(layer.mlp.experts.gate_up_proj, experts.gate_up_proj[local])
                assert torch.equal(layer.mlp.experts.down_proj, experts.down_proj[local])
            for param, value in ep.named_parameters():
                if ".experts." not in param:
                    assert torch.equal(value, sliced[param]), (name, param)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_the_weight_filter_leaves_other_ranks_experts_unread(checkpoints: dict[str, Any], placement: str) -> None:
    """``--enable-ep-weight-filter``: the per-expert tensors of the other rank are never read (the
    reader skips them by name), and the rank's model is the same."""
    from sonar.models.weights import iter_safetensors, safetensors_files

    path = checkpoints["mixtral"][0]
    tp = TensorParallel(1, 2)
    plain = load_model(str(path), dtype="float32", parallel=tp, expert_placement=placement).model
    filtered = load_model(str(path), dtype="float32", parallel=tp, expert_placement=placement, ep_weight_filter=True)
    for param, value in filtered.model.named_parameters():
        assert torch.equal(value, dict(plain.named_parameters())[param]), param
    theirs = TensorParallel(0, 2, expert_placement=placement).local_experts(4)
    names = [name for name, _ in iter_safetensors(safetensors_files(path), "lazy", plain.foreign_expert_tensor)]
    experts = {int(name.split(".experts.")[1].split(".")[0]) for name in names if ".experts." in name}
    assert experts == set(range(4)) - set(theirs)
    assert sum(".experts." not in name for name in names) == sum(
        ".experts." not in name for name, _ in iter_safetensors(safetensors_files(path))
    )


def _group_logits(pool: RankPool, size: int, placement: str, sources: list[str], out: Path) -> list[list[torch.Tensor]]:
    """Run `size` ranks (`ep_rank`) on a gloo world whose store this process holds."""
    pool.world("tests.models.ep_rank", size, [str(size), placement, str(out), *sources])
    return torch.load(out)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_two_ranks_give_the_logits_of_one(
    checkpoints: dict[str, Any], placement: str, rank_pool: RankPool, tmp_path: Path
) -> None:
    sources = [str(checkpoints[name][0]) for name in NAMES]
    got = _group_logits(rank_pool, 2, placement, sources, tmp_path / "logits.pt")
    for source, ranked in zip(sources, got):
        for want, have in zip(parallel_rank.one_rank_logits(source), ranked):
            assert have.shape == want.shape
            assert (have - want).abs().max() < ATOL, (source, placement)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_engine_at_two_ranks_equals_transformers(checkpoints: dict[str, Any], anyio_backend: str) -> None:
    """Mixtral through `sonar.open(tensor_parallel_size=2, enable_expert_parallel=True)`: greedy
    tokens of a batch equal transformers'."""
    path, hf = checkpoints["mixtral"]
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, 384, (n,), generator=gen).tolist() for n in (3, 17, 9)]
    params = sonar.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    async with sonar.open(
        str(path),
        dtype="float32",
        num_gpu_blocks_override=64,
        tensor_parallel_size=2,
        enable_expert_parallel=True,
        expert_placement_strategy="round_robin",
    ) as llm:
        outs = await llm.generate_many(prompts, params)
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            ref = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=8,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert out.token_ids == ref[0, len(prompt) :].tolist()


def test_settings_reach_the_engine_or_are_refused_by_name() -> None:
    config = EngineConfig.from_args(
        None, tensor_parallel_size=2, enable_expert_parallel=True, expert_placement_strategy="round_robin"
    )
    assert (config.enable_expert_parallel, config.expert_placement_strategy) == (True, "round_robin")
    assert not config.enable_ep_weight_filter
    with pytest.raises(ValueError, match="data_parallel_size 2 and tensor_parallel_size 1 is not supported"):
        EngineConfig.from_args(None, data_parallel_size=2, enable_expert_parallel=True)
    EngineConfig.from_args(None, data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="expert_placement_strategy must be one of linear, round_robin"):
        EngineConfig.from_args(None, expert_placement_strategy="random")
