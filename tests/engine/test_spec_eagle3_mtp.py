"""EAGLE-3 and MTP speculation through the whole engine: with temperature 0 the text is the plain
engine's, through prefix-cache hits, chunked prefills and n > 1, and what they are not served
with is refused at startup by name.

The targets and heads are the tiny random ones of `tests.models.test_eagle3` and
`tests.models.test_deepseek_mtp`, saved in the published checkpoint formats."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import sonar
from sonar import SamplingParams
from sonar.engine.config import EngineConfig
from sonar.engine.runner import ModelRunner
from sonar.models.errors import ModelLoadError
from tests.models.test_deepseek_mtp import Mtp
from tests.models.test_eagle3 import VOCAB, echo_head, make_target, random_head, save_head

pytestmark = pytest.mark.anyio

K = 3
PROMPTS = [
    "w5 w17 w3 w88 w41 w9",
    "w60 w2 w33 w71 w14 w60 w2 w33 w71 w14 w60 w2 w33",
    "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20 w21 w22",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=3, n=2, ignore_eos=True)


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def eagle3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("eagle3")
    target = make_target(root / "target")
    head = save_head(root / "head", random_head())
    return target.path, {"method": "eagle3", "model": str(head), "num_speculative_tokens": K}


@pytest.fixture(scope="module")
def eagle3_echo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("eagle3-echo")
    target = make_target(root / "target", echo=True)
    head = save_head(root / "head", echo_head(target), draft_vocab_size=VOCAB)
    return target.path, {"method": "eagle3", "model": str(head), "num_speculative_tokens": K}


@pytest.fixture(scope="module")
def mtp_echo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    return Mtp(echo=True).save(tmp_path_factory.mktemp("mtp-echo")), {"method": "mtp", "num_speculative_tokens": K}


@pytest.fixture(scope="module")
def mtp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    return Mtp().save(tmp_path_factory.mktemp("mtp")), {"method": "mtp", "num_speculative_tokens": K}


async def outputs(llm: sonar.LLM, params: SamplingParams) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in [await llm.generate(p, params) for p in PROMPTS]]


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
async def test_greedy_and_seeded_text_is_the_plain_engines(method: str, request, one_thread) -> None:
    """With a random head (drafts nearly always wrong): greedy and seeded n=2 output equal the
    plain engine's, through a first round (prefills chunked by an 8-token budget) and a second
    round that hits the prefix cache."""
    path, spec = request.getfixturevalue(method)
    common: dict[str, Any] = dict(dtype="float32", max_model_len=128, num_gpu_blocks_override=64, seed=0)
    async with sonar.open(str(path), **common) as plain:
        greedy = await outputs(plain, GREEDY)
        seeded = await outputs(plain, SEEDED)
    async with sonar.open(
        str(path), speculative_config=spec, max_num_batched_tokens=8, max_num_seqs=4, **common
    ) as llm:
        assert await outputs(llm, GREEDY) == greedy
        again = await llm.generate(PROMPTS[2], GREEDY)
        assert again.num_cached_tokens > 0
        assert [again.outputs[0].token_ids] == greedy[2]
        assert await outputs(llm, SEEDED) == seeded
        stats = await llm.stats()
    assert stats.spec_num_draft_tokens > 0


@pytest.mark.parametrize("method", ["eagle3_echo", "mtp_echo"])
async def test_a_head_that_knows_the_answer_has_every_draft_accepted(method: str, request, one_thread) -> None:
    """An echo target (it repeats its last token) and a head built to predict that: the text is
    the plain engine's, every draft is accepted, and a step keeps 1 + K tokens."""
    path, spec = request.getfixturevalue(method)
    common: dict[str, Any] = dict(dtype="float32", max_model_len=128, num_gpu_blocks_override=64, seed=0)
    async with sonar.open(str(path), **common) as plain:
        greedy = await outputs(plain, GREEDY)
    assert all(set(out[0]) == {out[0][0]} for out in greedy)  # the target does repeat itself
    async with sonar.open(str(path), speculative_config=spec, **common) as llm:
        assert await outputs(llm, GREEDY) == greedy
        stats = await llm.stats()
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0
    assert stats.spec_num_drafts <= len(PROMPTS) * -(-GREEDY.max_tokens // (K + 1))


def runner(path: Path, spec: dict[str, Any]) -> ModelRunner:
    return ModelRunner(
        EngineConfig.from_args(str(path), dtype="float32", num_gpu_blocks_override=16, speculative_config=spec)
    )


def test_unsupported_targets_are_refused_by_name(eagle3, mtp) -> None:
    llama, eagle3_spec = eagle3
    deepseek, mtp_spec = mtp
    with pytest.raises(ModelLoadError, match="mtp runs DeepSeek-V3's multi-token-prediction layers; LlamaForCausalLM"):
        runner(llama, mtp_spec)
    with pytest.raises(ModelLoadError, match="DeepseekV3ForCausalLM is not served with EAGLE"):
        runner(deepseek, eagle3_spec)


def test_the_old_name_deepseek_mtp_is_mtp() -> None:
    from sonar.core.speculative import SpeculativeConfig

    assert SpeculativeConfig.parse({"method": "deepseek_mtp", "num_speculative_tokens": 1}).method == "mtp"
    assert SpeculativeConfig.parse({"method": "mtp", "num_speculative_tokens": 2}).lookahead == 2


async def test_a_startup_with_a_foreign_head_fails_naming_it(mtp, one_thread) -> None:
    """Through `sonar.open` (the worker's startup): the typed error naming the family and feature."""
    deepseek, _ = mtp
    spec = {"method": "eagle3", "model": str(deepseek), "num_speculative_tokens": 2}
    with pytest.raises(ModelLoadError, match="DeepseekV3ForCausalLM is not served with EAGLE speculative decoding"):
        async with sonar.open(str(deepseek), dtype="float32", num_gpu_blocks_override=16, speculative_config=spec):
            pass


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
async def test_a_burst_that_is_preempted_keeps_greedy_text(method: str, request, one_thread) -> None:
    """Six requests at once in a KV cache too small for them: some are preempted and recomputed
    (the head's KV with them, over the same block tables); the text is the plain engine's."""
    import anyio

    path, spec = request.getfixturevalue(method)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    common: dict[str, Any] = dict(dtype="float32", max_model_len=128, seed=0)
    async with sonar.open(str(path), num_gpu_blocks_override=64, **common) as plain:
        expected = [(await plain.generate(p, params)).outputs[0].token_ids for p in PROMPTS]
    got: dict[tuple[int, int], list[int]] = {}
    async with sonar.open(str(path), num_gpu_blocks_override=10, speculative_config=spec, **common) as llm:

        async def one(i: int, j: int) -> None:
            out = await llm.generate(PROMPTS[i], params, cache_salt=f"salt-{i}-{j}")
            got[i, j] = out.outputs[0].token_ids

        async with anyio.create_task_group() as tg:
            for i in range(len(PROMPTS)):
                for j in range(2):
                    tg.start_soon(one, i, j)
        stats = await llm.stats()
    assert all(got[i, j] == expected[i] for i, j in got) and len(got) == 2 * len(PROMPTS)
    assert stats.num_preemptions > 0
    assert stats.num_free_blocks == 10
