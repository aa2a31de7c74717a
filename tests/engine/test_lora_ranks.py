"""LoRA adapters in a parallel group (`sonar.open(tensor_parallel_size=2 / pipeline_parallel_size=2,
enable_lora=True)`): real worker processes on gloo.

Each tensor rank holds its share of an adapter's factors (`AdapterSlots._shard`): the rows of B
for the column-parallel q/k/v and gate/up projections, the columns of A for the row-parallel o and
down projections, whose partial deltas the layer's all-reduce sums. Each stage of a pipeline
holds the factors of its own layers only. With ``fully_sharded_loras`` the rest of the work is
split too (`sonar.models.lora.ColumnShardedLoRALinear`, `RowShardedLoRALinear`). The greedy tokens of a batch that mixes two adapters of
different ranks with the base model are the single worker's, which are transformers+peft's.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import sonar
from sonar.sampling_params import SamplingParams
from tests.engine.conftest import TinyCheckpoint
from tests.lora.conftest import ALL_MODULES
from tests.models.conftest import hf_generate_batch

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("one_thread")]

TEXTS = ["w5 w17 w33 w2 w9", "w100 w250 w7", "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11", "w42"]
NEW_TOKENS = 10
#: The adapter each text runs with (None: the base model): both adapters and the base in one batch.
USES = ["a", None, "b", "a"]
#: Adapter name -> (rank, seed): two ranks, so a slot holds a rank below --max-lora-rank too.
ADAPTERS = {"a": (8, 1), "b": (4, 2)}
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
LORA: dict[str, Any] = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
BASE: dict[str, Any] = {"dtype": "float32", "num_gpu_blocks_override": 64}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def adapters(llama: TinyCheckpoint, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list]]:
    """Each adapter's folder and transformers+peft's greedy tokens for `TEXTS` with it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(llama.path))
    out = {}
    for name, (rank, seed) in ADAPTERS.items():
        torch.manual_seed(seed)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=ALL_MODULES, init_lora_weights=False)
        peft = get_peft_model(copy.deepcopy(llama.hf), config).eval()  # it wraps the model it is given
        with torch.no_grad():
            for param_name, param in peft.named_parameters():
                if "lora_B" in param_name:
                    param.mul_(0.5)  # a delta that changes greedy tokens yet keeps them away from ties
        folder = tmp_path_factory.mktemp(f"lora-{name}")
        peft.save_pretrained(str(folder))
        expected, _ = hf_generate_batch(peft, tokenizer, TEXTS, NEW_TOKENS)
        out[name] = (folder, expected)
    return out


async def _mixed(path: Path, adapters: dict[str, tuple[Path, list]], **args: Any) -> list[list[int]]:
    """Greedy tokens of `TEXTS`, each with its adapter of `USES`, all in one batch."""
    modules = [f"{name}={folder}" for name, (folder, _) in adapters.items()]
    tokens: list[list[int]] = [[] for _ in TEXTS]
    async with sonar.open(str(path), **BASE, **LORA, lora_modules=modules, **args) as llm:

        async def one(i: int) -> None:
            tokens[i] = (await llm.generate(TEXTS[i], GREEDY, lora=USES[i])).token_ids

        async with anyio.create_task_group() as tg:
            for i in range(len(TEXTS)):
                tg.start_soon(one, i)
    return tokens


@pytest.fixture(scope="module")
async def single(llama: TinyCheckpoint, adapters: dict[str, tuple[Path, list]]) -> list[list[int]]:
    """The single worker's tokens, checked against transformers(+peft) and against the base model's."""
    from transformers import AutoTokenizer

    base, _ = hf_generate_batch(llama.hf, AutoTokenizer.from_pretrained(str(llama.path)), TEXTS, NEW_TOKENS)
    tokens = await _mixed(llama.path, adapters)
    for i, (lora, got) in enumerate(zip(USES, tokens)):
        assert got == (base[i] if lora is None else adapters[lora][1][i]), (TEXTS[i], lora)
        if lora is not None:
            assert got != base[i], f"adapter {lora} does not change the greedy tokens of {TEXTS[i]!r}"
    return tokens


@pytest.mark.parametrize(
    ("tp", "pp", "fully_sharded"), [(2, 1, False), (2, 1, True), (1, 2, False)], ids=["tp2", "tp2-fully-sharded", "pp2"]
)
async def test_adapters_in_a_group_equal_the_single_worker(
    llama: TinyCheckpoint,
    adapters: dict[str, tuple[Path, list]],
    single: list[list[int]],
    tp: int,
    pp: int,
    fully_sharded: bool,
) -> None:
    """--fully-sharded-loras: each rank also holds half of each adapter's rank in q/k/v and gate/up
    (the shrink's halves gathered) and half of the output rows in o and down (the shrink summed)."""
    tokens = await _mixed(
        llama.path,
        adapters,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        fully_sharded_loras=fully_sharded,
    )
    assert tokens == single
