"""Expert load balancing on the ranks (``--enable-eplb``, `sonar.models.eplb`): the logical ->
physical expert map, what each rank loads into its slots (replicas included), a real two-rank gloo
group (one process per rank, `tests/models/eplb_rank.py`) whose rebalance moves expert weights
between the ranks and leaves the logits those of one rank, and the whole engine at two ranks
rebalancing mid-generation with transformers' greedy tokens."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import sonar
from sonar.engine.config import EngineConfig
from sonar.models.eplb import ExpertMap
from sonar.models.loader import load_model
from sonar.models.moe import SparseMoeBlock
from sonar.models.parallel import ParallelLayoutError, TensorParallel
from tests.engine.conftest import save_word_tokenizer, spread_weights
from tests.models import eplb_rank
from tests.models.rank_pool import RankPool
from tests.models.test_moe import _configs

NAMES = ("mixtral", "qwen3_moe")
REDUNDANT = 2
#: Float32 logits of the same products summed over two ranks, in another order (logits O(1)).
ATOL = 1e-5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    from transformers import AutoModelForCausalLM

    configs = _configs()
    out = {}
    for i, name in enumerate(NAMES):
        torch.manual_seed(70 + i)
        hf = AutoModelForCausalLM.from_config(configs[name], dtype=torch.float32).eval()
        spread_weights(hf)
        path = tmp_path_factory.mktemp(name)
        hf.save_pretrained(str(path))
        save_word_tokenizer(path, configs[name].vocab_size)
        out[name] = (path, hf)
    return out


def test_each_pair_goes_to_one_replica_and_is_counted() -> None:
    """Expert 0 has replicas in slot 0 (rank 0) and slot 4 (rank 1), expert 1 in slots 1 and 5: a
    pair goes to one of them by its index, every other expert's to its one slot, and each rank
    sees only its own (-1 elsewhere)."""
    maps = [ExpertMap(4, 6, TensorParallel(r, 2, expert_placement="linear")) for r in range(2)]
    assert maps[0].placement == [0, 1, 2, 3, 0, 1]
    assert (maps[0].local_experts, maps[1].local_experts) == ([0, 1, 2], [3, 0, 1])
    ids = torch.tensor([[0, 3], [0, 2], [1, 0]])
    local = [m.local_ids(ids).tolist() for m in maps]
    # pair i (row-major) goes to replica i mod replicas: expert 0's pairs 0, 2, 5 to slots 0, 0, 4
    assert local[0] == [[0, -1], [0, 2], [1, -1]]
    assert local[1] == [[-1, 0], [-1, -1], [-1, 1]]
    for row in range(3):  # every pair on exactly one rank
        for k in range(2):
            assert (local[0][row][k] >= 0) + (local[1][row][k] >= 0) == 1
    assert maps[0].load.tolist() == [3, 1, 1, 1]
    maps[0].set_placement([2, 2, 3, 0, 1, 2])  # in place: captured graphs keep reading the same tensors
    assert maps[0].local_ids(torch.tensor([[2, 2], [2, 0]])).tolist() == [[0, 1], [-1, -1]]


def test_slots_that_do_not_divide_over_the_ranks_fail_naming_the_count() -> None:
    spec_parallel = TensorParallel(0, 2, expert_placement="linear", redundant_experts=1)
    with pytest.raises(ParallelLayoutError, match=r"experts plus num_redundant_experts \(4 \+ 1\)"):
        ExpertMap(4, 5, spec_parallel)


def test_each_rank_loads_its_slots_replicas_included(checkpoints: dict[str, Any]) -> None:
    path = str(checkpoints["mixtral"][0])
    whole = load_model(path, dtype="float32").model
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        ep = load_model(path, dtype="float32", parallel=tp, expert_placement="linear", redundant_experts=REDUNDANT)
        for i, layer in enumerate(ep.model.model.layers):
            block = layer.mlp
            assert isinstance(block, SparseMoeBlock) and block.expert_map is not None
            assert block.local_experts == [[0, 1, 2], [3, 0, 1]][rank]
            experts = whole.model.layers[i].mlp.experts
            assert torch.equal(block.experts.gate_up_proj, experts.gate_up_proj[block.local_experts])
            assert torch.equal(block.experts.down_proj, experts.down_proj[block.local_experts])


#: Per model: redundant slots, and sets of experts that only one rank holds at first (linear slots:
#: Mixtral's 4 experts two a rank; Qwen3-MoE's 8 plus 2 replicas, [0..4] and [5, 6, 7, 0, 1]).
SKEW = {"mixtral": (0, [{0, 1}, {2, 3}]), "qwen3_moe": (REDUNDANT, [{2, 3, 4}, {5, 6, 7}])}


def hot_token(hf: Any, alone: list[set[int]]) -> int:
    """A token whose repeated prompt sends, in some sparse layer, every row to two experts that one
    rank alone holds: the skewed load a rebalance has to spread over both ranks."""
    for token in range(1, hf.config.vocab_size):
        with torch.inference_mode():
            out = hf(torch.tensor([[token] * eplb_rank.PROMPT_LEN]), output_router_logits=True)
        for logits in out.router_logits:
            hot = set(logits.reshape(-1, logits.shape[-1])[-1].topk(2).indices.tolist())
            if any(hot <= experts for experts in alone):
                return token
    raise AssertionError("no token routes to one rank's experts alone")


def _group(pool: RankPool, size: int, sources: list[str], out: Path) -> list[list[dict[str, Any]]]:
    """Run `size` ranks (`eplb_rank`) on a gloo world whose store this process holds; each rank's results."""
    pool.world("tests.models.eplb_rank", size, [str(size), str(out), *sources])
    return [torch.load(f"{out}.{rank}") for rank in range(size)]


@pytest.mark.slow  # two rank processes, each loading both models: ~20 s here
def test_a_rebalance_moves_experts_between_ranks_and_keeps_the_logits(
    checkpoints: dict[str, Any], rank_pool: RankPool, tmp_path: Path
) -> None:
    """A skewed load (one rank's experts take every token), two rounds of the same steps with a
    rebalance between them: the placement changes on both ranks alike, experts move between the
    ranks, the window's balance improves, and both rounds' logits are one rank's."""
    tokens = {name: hot_token(checkpoints[name][1], SKEW[name][1]) for name in NAMES}
    sources = [f"{checkpoints[name][0]}:{SKEW[name][0]}:{tokens[name]}" for name in NAMES]
    ranks = _group(rank_pool, 2, sources, tmp_path / "eplb.pt")
    for i, name in enumerate(NAMES):
        mine, theirs = ranks[0][i], ranks[1][i]
        assert mine["placements"] == theirs["placements"]
        _, before, after = mine["placements"]
        assert before != after, name
        (record,) = mine["history"]
        assert record["experts_moved"] > 0 and record["layers_changed"] > 0, record
        assert record["balancedness_after"] > record["balancedness_before"], record
        for rank, result in enumerate(ranks):
            slots = len(after[0]) // 2
            assert result[i]["local"] == [layer[rank * slots : (rank + 1) * slots] for layer in after]
        want = eplb_rank.balanced_run(str(checkpoints[name][0]), tokens[name])["rounds"]
        for rounds in (mine["rounds"], want[1:]):
            for have, ref in zip(rounds[0] + rounds[-1], want[0] + want[0]):
                assert have.shape == ref.shape
                assert (have - ref).abs().max() < ATOL, name


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_engine_rebalancing_mid_generation_equals_transformers(
    checkpoints: dict[str, Any], anyio_backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Qwen3-MoE through `sonar.open(tensor_parallel_size=2, enable_expert_parallel=True,
    enable_eplb=True)`, rebalancing every 3 steps: greedy tokens of a batch equal transformers',
    and rank 0's log shows the rebalances, experts moved between the ranks by some of them."""
    logfile = tmp_path / "ranks.log"
    handler = {"class": "logging.FileHandler", "filename": str(logfile), "formatter": "plain"}
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(name)s %(message)s"}},
        "handlers": {"file": handler},
        "loggers": {"sonar.eplb": {"handlers": ["file"], "level": "INFO", "propagate": False}},
    }
    (tmp_path / "logging.json").write_text(json.dumps(config))
    monkeypatch.setenv("SONAR_LOG_CONFIG_FILE", str(tmp_path / "logging.json"))
    path, hf = checkpoints["qwen3_moe"]
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(1, 384, (n,), generator=gen).tolist() for n in (3, 17, 9)]
    params = sonar.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    async with sonar.open(
        str(path),
        dtype="float32",
        num_gpu_blocks_override=64,
        tensor_parallel_size=2,
        enable_expert_parallel=True,
        enable_eplb=True,
        eplb_config={
            "window_size": 4,
            "step_interval": 3,
            "num_redundant_experts": REDUNDANT,
            "log_balancedness": True,
        },
    ) as llm:
        outs = await llm.generate_many(prompts, params)
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            ref = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=10,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert out.token_ids == ref[0, len(prompt) :].tolist()
    log = logfile.read_text()
    moved = [int(n) for n in re.findall(r"eplb\.rebalanced .*experts_moved=(\d+)", log)]
    assert len(moved) == 3 and any(moved), log  # steps 3, 6, 9 of the 10 (+ the prefill's)
    assert "eplb.balancedness" in log


def test_settings_reach_the_engine_or_are_refused_by_name() -> None:
    config = EngineConfig.from_args(
        None,
        tensor_parallel_size=2,
        enable_expert_parallel=True,
        enable_eplb=True,
        eplb_config='{"window_size": 10, "num_redundant_experts": 2}',
    )
    assert (config.eplb().window_size, config.eplb().num_redundant_experts) == (10, 2)
    assert EngineConfig.from_args(None).eplb() is None
    refusals = [
        (dict(enable_eplb=True), "enable_eplb needs enable_expert_parallel"),
        (dict(enable_eplb=True, enable_expert_parallel=True), "tensor_parallel_size 1 is not supported"),
        (dict(eplb_config={"window_size": 3}), r"eplb_config \(window_size\) is set but expert load balancing is off"),
        (
            dict(
                tensor_parallel_size=2, enable_expert_parallel=True, enable_eplb=True, eplb_config={"use_async": True}
            ),
            "use_async true is not supported",
        ),
    ]
    for args, message in refusals:
        with pytest.raises(ValueError, match=message):
            EngineConfig.from_args(None, **args)
