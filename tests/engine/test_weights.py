"""Weight updates on a real engine (``weight_transfer_config``; `sonar.engine.weights`): an engine
serving checkpoint A takes checkpoint B's weights from disk and as tensors over the transport,
and its greedy answer becomes transformers' answer on B; an update that does not fit is refused
and A's answer stays; a request running during an update completes.

The checkpoints are tiny random-weight Llamas saved by transformers in the test (float32, served
in float32, so Sonar's greedy tokens equal transformers').
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from safetensors.torch import load_file

import sonar
from sonar import SamplingParams
from sonar.core.weights import WeightUpdateConflictError, WeightUpdateError
from sonar.errors import InvalidRequestError, NotEnabledError
from tests.engine.conftest import save_word_tokenizer, spread_weights
from tests.models.against import transformers_greedy

pytestmark = pytest.mark.anyio

VOCAB = 512
PROMPTS = [[5, 17, 300, 9], [100, 2, 3, 4, 5, 6]]
NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
ENGINE = dict(
    dtype="float32", max_model_len=256, num_gpu_blocks_override=64, weight_transfer_config={"backend": "sonar"}
)


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


def save_llama(path: Path, seed: int, intermediate_size: int = 128) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    spread_weights(model)
    model.save_pretrained(str(path))
    save_word_tokenizer(path, VOCAB)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    out = {}
    for name, seed, inter in (("a", 1, 128), ("b", 2, 128), ("wide", 3, 192)):
        path = tmp_path_factory.mktemp(f"llama-{name}")
        out[name] = (path, save_llama(path, seed, inter))
    return out


def expected(hf: Any) -> list[list[int]]:
    return [transformers_greedy(hf, prompt, NEW_TOKENS)[0] for prompt in PROMPTS]


async def answers(llm: sonar.LLM) -> list[list[int]]:
    return [o.token_ids for o in await llm.generate_many(PROMPTS, GREEDY)]


async def test_updates_from_disk_and_tensors_change_the_answer(checkpoints: dict, one_thread) -> None:
    (path_a, hf_a), (path_b, hf_b), (path_wide, _) = checkpoints["a"], checkpoints["b"], checkpoints["wide"]
    want_a, want_b = expected(hf_a), expected(hf_b)
    assert want_a != want_b
    # the worker in a process of its own: the tensors cross the transport (msgspec frames over ZMQ)
    async with sonar.open(str(path_a), **ENGINE, placement={"worker": "process"}) as llm:
        assert await answers(llm) == want_a

        # from disk: the whole checkpoint B
        done = await llm.update_weights(path_b)
        assert done.tensors == len(load_file(str(path_b / "model.safetensors"))) and done.updates == 1
        assert done.bytes > 0
        assert await answers(llm) == want_b

        # a checkpoint of other shapes: refused, B's weights stay
        with pytest.raises(WeightUpdateError, match="has shape"):
            await llm.update_weights(path_wide)
        with pytest.raises(WeightUpdateError, match="not a directory"):
            await llm.update_weights(path_b / "missing")
        assert await answers(llm) == want_b

        # tensors over the transport: A's weights, in two calls (any subset goes)
        tensors_a = load_file(str(path_a / "model.safetensors"))
        names = sorted(tensors_a)
        await llm.update_weights(tensors={n: tensors_a[n] for n in names[: len(names) // 2]})
        await llm.update_weights(tensors={n: tensors_a[n] for n in names[len(names) // 2 :]})
        assert await answers(llm) == want_a

        # names, shapes and dtypes are checked before anything is written
        bad_updates = [
            ({"model.layers.0.mlp.up_proj.weight": torch.zeros(64, 64)}, "has shape"),
            ({"model.layers.9.mlp.up_proj.weight": torch.zeros(128, 64)}, "no weight named"),
            ({"model.norm.weight": torch.ones(64, dtype=torch.bfloat16)}, "served dtype, float32"),
            ({"model.norm.weight": [1.0] * 64}, "takes tensors"),
            ({}, "holds no tensor"),
        ]
        for update, message in bad_updates:
            with pytest.raises(WeightUpdateError, match=message):
                await llm.update_weights(tensors=update)
        # a refused update among good ones: nothing of the call is written
        mixed = {"model.norm.weight": torch.zeros(64), "lm_head.weight": torch.zeros(VOCAB, 32)}
        with pytest.raises(WeightUpdateError, match="lm_head.weight has shape"):
            await llm.update_weights(tensors=mixed)
        assert await answers(llm) == want_a

        # one update at a time: a second one sent meanwhile is refused as a conflict (409)
        outcomes: list[Any] = []

        async def update() -> None:
            try:
                outcomes.append(await llm.update_weights(path_b))
            except WeightUpdateConflictError as exc:
                outcomes.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(update)
            tg.start_soon(update)
        assert sorted(type(o).__name__ for o in outcomes) == ["WeightUpdateConflictError", "WeightsUpdated"]
        assert "another weight update is under way" in str(next(o for o in outcomes if isinstance(o, Exception)))
        assert await answers(llm) == want_b


async def test_the_prefix_cache_is_dropped_and_a_running_request_completes(checkpoints: dict, one_thread) -> None:
    (path_a, hf_a), (path_b, hf_b) = checkpoints["a"], checkpoints["b"]
    prompt = list(range(1, 49))  # three full blocks of 16
    one = SamplingParams(temperature=0, max_tokens=1)
    engine = {
        **ENGINE,
        "weight_transfer_config": {"backend": "sonar", "max_update_bytes": 100_000},
        "enable_sleep_mode": True,
    }
    async with sonar.open(str(path_a), **engine) as llm:
        embed = load_file(str(path_b / "model.safetensors"))["model.embed_tokens.weight"]  # 128 KiB
        with pytest.raises(WeightUpdateError, match="over 100000 bytes.*max_update_bytes"):
            await llm.update_weights(tensors={"model.embed_tokens.weight": embed})
        await llm.generate(prompt, one)
        assert (await llm.generate(prompt, one)).num_cached_tokens == 32
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        results: list = []

        async def run() -> None:
            results.append(await llm.generate([7, 8, 9], long))

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            with anyio.fail_after(10):
                while (await llm.tracked_requests())["scheduler"] == 0:
                    await anyio.sleep(0.005)
            await llm.update_weights(path_b)
        # the running request went on (with B's weights for its last tokens) to its full length
        assert len(results[0].token_ids) == 200 and results[0].finish_reason == "length"
        # its blocks (KV of A's weights, then B's over it) stayed out of the prefix cache
        follow_up = [7, 8, 9, *results[0].token_ids[:100]]
        assert (await llm.generate(follow_up, one)).num_cached_tokens == 0
        assert (await llm.generate(follow_up, one)).num_cached_tokens == 96  # B's own blocks are cached
        after = await llm.generate(prompt, one)
        assert after.num_cached_tokens == 0  # no KV of A's weights is reused
        assert after.token_ids == transformers_greedy(hf_b, prompt, 1)[0]
        assert await answers(llm) == expected(hf_b)

        # the RL loop with sleep mode: weights asleep at level 2 cannot be updated; woken, they can
        await llm.sleep(2)
        with pytest.raises(WeightUpdateConflictError, match="asleep"):
            await llm.update_weights(path_a)
        await llm.wake_up(["weights"])
        await llm.update_weights(path_a)
        await llm.wake_up(["kv_cache"])
        assert await answers(llm) == expected(hf_a)


async def test_every_replica_is_updated(checkpoints: dict, one_thread) -> None:
    (path_a, hf_a), (path_b, hf_b) = checkpoints["a"], checkpoints["b"]
    async with sonar.open(str(path_a), **ENGINE, data_parallel_size=2) as llm:
        assert await answers(llm) == expected(hf_a)
        await llm.update_weights(path_b)
        for _ in range(3):  # whichever replica the router picks
            assert await answers(llm) == expected(hf_b)


async def test_updates_need_the_flag_and_a_safetensors_model(checkpoints: dict, one_thread) -> None:
    path_a, _ = checkpoints["a"]
    async with sonar.open(str(path_a), **{**ENGINE, "weight_transfer_config": None}) as llm:
        with pytest.raises(NotEnabledError, match="--weight-transfer-config"):
            await llm.update_weights(path_a)
    async with sonar.open(str(path_a), **ENGINE, load_format="dummy") as llm:
        with pytest.raises(WeightUpdateError, match="not loaded from safetensors weights"):
            await llm.update_weights(path_a)
        with pytest.raises(InvalidRequestError, match="one of the two"):
            await llm.update_weights()


def test_refused_backends_and_fields() -> None:
    from sonar.engine.config import EngineConfig

    with pytest.raises(ValueError, match="backend 'nccl'.*not supported"):
        EngineConfig.from_args(None, weight_transfer_config={"backend": "nccl"})
    with pytest.raises(ValueError, match="unknown backend 'rdma'"):
        EngineConfig.from_args(None, weight_transfer_config={"backend": "rdma"})
    with pytest.raises(ValueError, match="unknown field"):
        EngineConfig.from_args(None, weight_transfer_config={"backend": "sonar", "chunk": 3})
    with pytest.raises(ValueError, match="tensor / pipeline"):
        EngineConfig.from_args(None, weight_transfer_config={"backend": "sonar"}, tensor_parallel_size=2)
