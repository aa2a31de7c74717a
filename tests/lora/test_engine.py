"""LoRA adapters through the whole engine (`sonar.open(..., enable_lora=True)`), against
transformers + peft on the same weights and adapters (built in the test with peft):

* the embedded SmolLM2 with three adapters (plain, rsLoRA with per-module ranks and alphas,
  attention-only) and a tiny random Qwen3 with two: each request's greedy tokens equal peft's and
  its top-5 logprobs are close; a batch mixing the three adapters and the base model gives each
  request the tokens it gets alone, and so does one with fewer slots than adapters (requests of
  the others wait their turn);
* the prefix cache keys blocks by adapter, and KV offloading keeps them apart in its tiers;
* adapters loaded and unloaded while requests run lose none of them.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import sonar
from sonar.errors import LoRAError, LoRANotFoundError
from sonar.sampling_params import SamplingParams
from tests.lora.conftest import Built, Tiny, make_adapter, peft_greedy

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("one_thread")]

NEW_TOKENS = 10
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a quiet village by the sea,"]


async def _generate_all(llm: Any, prompts: list[list[int]], names: list[str | None], mixed: bool) -> dict:
    """Each (adapter, prompt) pair's output: one request at a time, or all at once."""
    out: dict[tuple[str | None, int], Any] = {}

    async def one(name: str | None, i: int) -> None:
        out[(name, i)] = await llm.generate(prompts[i], GREEDY, lora=name)

    if not mixed:
        for name in names:
            for i in range(len(prompts)):
                await one(name, i)
        return out
    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            for name in names:
                tg.start_soon(one, name, i)
    return out


def _assert_matches_peft(outputs: dict, reference: dict[str | None, Any], prompts: list[list[int]]) -> None:
    for (name, i), result in outputs.items():
        tokens, logits = reference[name]
        assert result.token_ids == tokens[i], (name, i)
        logprobs = torch.log_softmax(logits[i], dim=-1)
        expected = logprobs[torch.arange(NEW_TOKENS), torch.tensor(tokens[i])]
        got = torch.tensor([position.logprob for position in result.logprobs])
        torch.testing.assert_close(got, expected, atol=2e-3, rtol=0)
        top = torch.tensor([[alt.logprob for alt in position.top] for position in result.logprobs])
        torch.testing.assert_close(top, logprobs.topk(5, dim=-1).values, atol=2e-3, rtol=0)


async def test_smollm2_adapters_equal_peft_alone_and_in_one_batch(
    smollm2_hf: Any, smollm2_adapters: dict[str, Built]
) -> None:
    modules = [f"{name}={built.path}" for name, built in smollm2_adapters.items()]
    names: list[str | None] = [None, *smollm2_adapters]
    async with sonar.open(
        None, dtype="float32", dequantize_weights=True, enable_lora=True, max_loras=3, lora_modules=modules
    ) as llm:
        prompts = [await llm.tokenize(text) for text in TEXTS]
        alone = await _generate_all(llm, prompts, names, mixed=False)
        mixed = await _generate_all(llm, prompts, names, mixed=True)
        assert [a.request.name for a in llm.loras()] == list(smollm2_adapters)
    reference = {
        name: peft_greedy(smollm2_hf, None if name is None else smollm2_adapters[name].path, prompts, NEW_TOKENS)
        for name in names
    }
    _assert_matches_peft(alone, reference, prompts)
    assert {key: out.token_ids for key, out in mixed.items()} == {key: out.token_ids for key, out in alone.items()}
    for name in smollm2_adapters:  # each adapter changes what the model says
        assert any(alone[(name, i)].token_ids != alone[(None, i)].token_ids for i in range(len(prompts)))


def _random_prompts(lengths: tuple[int, ...], seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 384, (n,), generator=g).tolist() for n in lengths]


async def test_tiny_qwen3_adapters_one_slot_and_the_prefix_cache(tiny_qwen3: Tiny) -> None:
    prompts = _random_prompts((5, 40, 23))
    names: list[str | None] = [None, *tiny_qwen3.adapters]
    modules = [f"{name}={built.path}" for name, built in tiny_qwen3.adapters.items()]
    async with sonar.open(
        str(tiny_qwen3.path), dtype="float32", block_size=16, enable_lora=True, max_loras=1, lora_modules=modules
    ) as llm:
        mixed = await _generate_all(llm, prompts, names, mixed=True)
        # the same 40-token prompt: the adapter's earlier blocks serve it, never the base model's
        again = await llm.generate(prompts[1], GREEDY, lora="all")
        base = await llm.generate(prompts[1], GREEDY)
        other = await llm.generate(prompts[1], GREEDY, lora="mlp")
    reference = {
        name: peft_greedy(tiny_qwen3.hf, None if name is None else tiny_qwen3.adapters[name].path, prompts, NEW_TOKENS)
        for name in names
    }
    _assert_matches_peft(mixed, reference, prompts)
    assert again.token_ids == mixed[("all", 1)].token_ids and again.num_cached_tokens == 32
    assert base.token_ids == mixed[(None, 1)].token_ids and base.num_cached_tokens == 32
    assert other.token_ids == mixed[("mlp", 1)].token_ids
    assert len({mixed[(name, 1)].token_ids[0] for name in names}) > 1


async def test_offloaded_blocks_stay_with_their_adapter(tiny_qwen3: Tiny) -> None:
    """Blocks evicted to the CPU tier come back only for requests of the same adapter."""
    prompts = _random_prompts((150, 150, 150), seed=9)
    transfer = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"blocks_per_chunk": 1, "cpu_size_gib": 0.01},
    }
    built = tiny_qwen3.adapters["all"]
    args: dict[str, Any] = dict(
        dtype="float32",
        max_model_len=192,
        num_gpu_blocks_override=12,
        block_size=16,
        max_num_seqs=4,
        enable_lora=True,
        lora_modules=[f"all={built.path}"],
    )
    async with sonar.open(str(tiny_qwen3.path), **args, kv_transfer_config=transfer) as llm:
        first = await llm.generate(prompts[0], GREEDY, lora="all")
        for p in prompts[1:]:  # evict prompt 0's blocks from the primary cache
            await llm.generate(p, GREEDY, lora="all")
        await anyio.sleep(1.0)  # the stores reach the CPU tier
        base = await llm.generate(prompts[0], GREEDY)
        await anyio.sleep(1.0)
        for p in prompts[1:]:
            await llm.generate(p, GREEDY)
        await anyio.sleep(1.0)
        again = await llm.generate(prompts[0], GREEDY, lora="all")
    reference = peft_greedy(tiny_qwen3.hf, built.path, prompts[:1], NEW_TOKENS)[0][0]
    base_reference = peft_greedy(tiny_qwen3.hf, None, prompts[:1], NEW_TOKENS)[0][0]
    assert first.token_ids == again.token_ids == reference
    assert base.token_ids == base_reference and base.num_cached_tokens == 0
    assert again.num_cached_tokens == 144  # 9 blocks from the CPU tier


async def test_loading_and_unloading_while_requests_run(tiny_qwen3: Tiny, tmp_path: Path) -> None:
    prompts = _random_prompts((12, 30, 7, 19), seed=4)
    extra = make_adapter(tiny_qwen3.hf, tmp_path / "extra", seed=40, b_scale=1.0)
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    async with sonar.open(
        str(tiny_qwen3.path),
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        lora_modules=[f"all={tiny_qwen3.adapters['all'].path}"],
    ) as llm:
        expected = {
            (name, i): (await llm.generate(p, long, lora=name)).token_ids
            for name in (None, "all")
            for i, p in enumerate(prompts)
        }
        results: dict[tuple[str | None, int], list[int]] = {}

        async def one(name: str | None, i: int) -> None:
            results[(name, i)] = (await llm.generate(prompts[i], long, lora=name)).token_ids

        async with anyio.create_task_group() as tg:
            for key in expected:
                tg.start_soon(one, *key)
            await anyio.sleep(0.05)
            await llm.load_lora("extra", str(extra.path))
            mid = await llm.generate(prompts[0], GREEDY, lora="extra")
            llm.unload_lora("all")  # its requests in flight finish with it
            with pytest.raises(LoRAError, match="no LoRA adapter named 'all'"):
                llm.unload_lora("all")
        assert results == expected
        with pytest.raises(LoRANotFoundError, match="no LoRA adapter named 'all' is loaded"):
            await llm.generate(prompts[0], GREEDY, lora="all")
    assert mid.token_ids == peft_greedy(tiny_qwen3.hf, extra.path, prompts[:1], NEW_TOKENS)[0][0]


async def test_lora_calls_need_enable_lora(tiny_qwen3: Tiny) -> None:
    async with sonar.open(str(tiny_qwen3.path), dtype="float32") as llm:
        with pytest.raises(LoRAError, match="LoRA adapters are off; start the engine with enable_lora"):
            await llm.load_lora("a", str(tiny_qwen3.adapters["all"].path))
        with pytest.raises(LoRANotFoundError, match="no LoRA adapter named 'a'"):
            await llm.generate([1, 2, 3], GREEDY, lora="a")


async def test_a_bad_lora_module_fails_the_start(tiny_qwen3: Tiny, tmp_path: Path) -> None:
    with pytest.raises(LoRAError, match="rank 16 exceeds --max-lora-rank 8"):
        async with sonar.open(
            str(tiny_qwen3.path),
            dtype="float32",
            enable_lora=True,
            max_lora_rank=8,
            lora_modules=[f"mlp={tiny_qwen3.adapters['mlp'].path}"],
        ):
            pass


async def test_an_adapter_whose_folder_vanished_fails_its_requests_alone(tiny_qwen3: Tiny, tmp_path: Path) -> None:
    """Evicted from its slot and from host memory, an adapter comes back from its folder; when the
    folder is gone its requests fail with the reason, the others are served, the worker stays up,
    and nothing the failed requests computed is served from the cache later."""
    folder = tmp_path / "gone"
    shutil.copytree(tiny_qwen3.adapters["all"].path, folder)
    prompts = _random_prompts((40, 21), seed=5)
    async with sonar.open(
        str(tiny_qwen3.path),
        dtype="float32",
        block_size=16,
        enable_lora=True,
        max_loras=1,
        max_cpu_loras=1,
        lora_modules=[f"gone={folder}", f"mlp={tiny_qwen3.adapters['mlp'].path}"],
    ) as llm:
        first = await llm.generate(prompts[0], GREEDY, lora="gone")
        await llm.generate(prompts[1], GREEDY, lora="mlp")  # takes the slot and the host memory
        shutil.rmtree(folder)
        results: dict[str, Any] = {}

        async def one(name: str | None) -> None:
            try:
                results[str(name)] = await llm.generate(prompts[1], GREEDY, lora=name)
            except LoRAError as exc:
                results[str(name)] = exc

        async with anyio.create_task_group() as tg:
            for name in ("gone", None, "mlp"):
                tg.start_soon(one, name)
        shutil.copytree(tiny_qwen3.adapters["all"].path, folder)  # back, unchanged
        again = await llm.generate(prompts[1], GREEDY, lora="gone")
        restarts = llm.tree().find("worker").restarts
    assert isinstance(results["gone"], LoRAError) and "is not a directory" in str(results["gone"])
    reference = {
        name: peft_greedy(tiny_qwen3.hf, path, prompts, NEW_TOKENS)[0]
        for name, path in (
            ("gone", tiny_qwen3.adapters["all"].path),
            ("None", None),
            ("mlp", tiny_qwen3.adapters["mlp"].path),
        )
    }
    assert results["None"].token_ids == reference["None"][1] and results["mlp"].token_ids == reference["mlp"][1]
    assert first.token_ids == reference["gone"][0]
    assert again.token_ids == reference["gone"][1] and again.num_cached_tokens == 0
    assert restarts == 0


async def test_lora_dtype_sets_the_slots_precision(tiny_qwen3: Tiny) -> None:
    """float16 slots under a float32 model: the same greedy tokens as peft's, logprobs a rounding
    away from float32 slots' (so the flag took effect)."""
    prompts = _random_prompts((12, 25), seed=6)
    built = tiny_qwen3.adapters["all"]
    logprobs = {}
    for dtype in ("auto", "float16"):
        async with sonar.open(
            str(tiny_qwen3.path),
            dtype="float32",
            enable_lora=True,
            lora_dtype=dtype,
            lora_modules=[f"all={built.path}"],
        ) as llm:
            outs = [await llm.generate(p, GREEDY, lora="all") for p in prompts]
        reference = peft_greedy(tiny_qwen3.hf, built.path, prompts, NEW_TOKENS)[0]
        assert [o.token_ids for o in outs] == reference
        logprobs[dtype] = torch.tensor([[p.logprob for p in o.logprobs] for o in outs])
    torch.testing.assert_close(logprobs["float16"], logprobs["auto"], atol=5e-3, rtol=0)
    assert not torch.equal(logprobs["float16"], logprobs["auto"])
