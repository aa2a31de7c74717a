"""EAGLE, EAGLE-3 and MTP heads in a parallel group (tensor and pipeline ranks: real worker
processes on gloo).

A head runs on the sampler (tensor rank 0 of the last stage) on the last stage's final states; with
tensor parallelism the group gathers the target's embeddings and LM head whole for it once at load
(`sonar.models.head_vocab`). EAGLE-3 reads target layers 2, 4 and 5 of 8: across two stages the
first stage sends layer 2's input on with its activations, and layer 4 is the second's first. Random heads (drafts nearly always wrong): greedy and seeded ``n = 2``
text is the single worker's without speculation, and the head drafts and gets accepted exactly as
often as on one worker (the same drafts). Heads built for an echoing target: every draft is kept,
which only a head reading the right states and vocabulary can do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import sonar
from sonar.sampling_params import SamplingParams
from tests.models.test_deepseek_mtp import Mtp
from tests.models.test_eagle import reference_head
from tests.models.test_eagle import save_head as save_eagle_head
from tests.models.test_eagle3 import VOCAB, echo_head, make_target, random_head, save_head

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("one_thread"), pytest.mark.slow]

K = 3
PROMPTS = [
    "w5 w17 w3 w88 w41 w9",
    "w60 w2 w33 w71 w14 w60 w2 w33 w71 w14",
    "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13",
]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=3, n=2, ignore_eos=True)
BASE: dict[str, Any] = dict(dtype="float32", max_model_len=128, num_gpu_blocks_override=64, seed=0)
LAYOUTS = {"tp2": dict(tensor_parallel_size=2), "pp2": dict(pipeline_parallel_size=2)}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def heads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Each method's (target, speculative config): random heads, and echo ones (``*_echo``)."""
    root = tmp_path_factory.mktemp("heads")
    llama = make_target(root / "llama")
    stack, fc = reference_head(llama, False)
    save_eagle_head(root / "eagle", stack, fc)
    echo = make_target(root / "echo", echo=True)

    def spec(method: str, model: Path | None = None) -> dict[str, Any]:
        return {"method": method, "num_speculative_tokens": K, **({"model": str(model)} if model else {})}

    return {
        "eagle": (llama.path, spec("eagle", root / "eagle")),
        "draft_model": (llama.path, spec("draft_model", llama.path)),
        "eagle3": (llama.path, spec("eagle3", save_head(root / "eagle3", random_head()))),
        "mtp": (Mtp().save(root / "mtp"), spec("mtp")),
        "eagle3_echo": (echo.path, spec("eagle3", save_head(root / "e3echo", echo_head(echo), draft_vocab_size=VOCAB))),
        "mtp_echo": (Mtp(echo=True).save(root / "mtp-echo"), spec("mtp")),
    }


async def _run(path: Path, **args: Any) -> tuple[list[Any], Any]:
    async with sonar.open(str(path), **BASE, **args) as llm:
        greedy = [[c.token_ids for c in out.outputs] for out in await llm.generate_many(PROMPTS, GREEDY)]
        seeded = [[c.token_ids for c in (await llm.generate(p, SEEDED)).outputs] for p in PROMPTS]
        return [greedy, seeded], await llm.stats()


@pytest.fixture(scope="module")
async def single(heads: dict[str, tuple[Path, dict[str, Any]]]) -> dict[str, tuple[list[Any], Any]]:
    """On one worker: each target's text without speculation, and each head's counts with it."""
    out: dict[str, tuple[list[Any], Any]] = {}
    for method in ("eagle", "mtp"):  # eagle3's target is eagle's
        path, spec = heads[method]
        out[str(path)] = await _run(path)
    for method in ("eagle", "eagle3", "mtp"):
        path, spec = heads[method]
        out[method] = await _run(path, speculative_config=spec)
    return out


@pytest.mark.parametrize(
    ("method", "layout"),
    [("eagle", "tp2"), ("eagle", "pp2"), ("eagle3", "tp2"), ("eagle3", "pp2"), ("mtp", "tp2"), ("mtp", "pp2")],
)
async def test_a_head_in_a_group_keeps_the_single_workers_text(
    heads: dict[str, Any], single: dict[str, Any], method: str, layout: str
) -> None:
    path, spec = heads[method]
    text, stats = await _run(path, speculative_config=spec, **LAYOUTS[layout])
    assert text == single[str(path)][0]
    one = single[method][1]
    assert stats.spec_num_draft_tokens > 0
    assert (stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens) == (
        one.spec_num_draft_tokens,
        one.spec_num_accepted_tokens,
    )


@pytest.mark.parametrize(
    ("method", "layout"), [("eagle3_echo", "tp2"), ("eagle3_echo", "pp2"), ("mtp_echo", "tp2"), ("mtp_echo", "pp2")]
)
async def test_a_head_that_knows_the_answer_has_every_draft_kept_in_a_group(
    heads: dict[str, Any], method: str, layout: str
) -> None:
    path, spec = heads[method]
    async with sonar.open(str(path), **BASE, speculative_config=spec, **LAYOUTS[layout]) as llm:
        outs = [o.outputs[0].token_ids for o in await llm.generate_many(PROMPTS, GREEDY)]
        stats = await llm.stats()
    assert all(len(set(out)) == 1 and len(out) == GREEDY.max_tokens for out in outs)  # the target repeats itself
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0


@pytest.mark.parametrize("method", ["draft_model", "eagle3", "mtp"])
async def test_async_drafts_in_tensor_ranks_keep_the_single_workers_text(
    heads: dict[str, Any], single: dict[str, Any], method: str
) -> None:
    """With async scheduling the sampler keeps each step's drafts for the request's next step and
    sends them to the other tensor rank, which fills the same draft slots with the same tokens."""
    path, spec = heads[method]
    text, stats = await _run(path, speculative_config=spec, async_scheduling=True, tensor_parallel_size=2)
    assert text == single[str(path)][0]
    assert stats.steps_overlapped > 0 and stats.spec_num_draft_tokens > 0
    if method == "draft_model":
        assert stats.spec_num_accepted_tokens > 0
