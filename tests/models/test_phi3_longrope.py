"""LongRoPE (Phi-3, Phi-4) served past ``original_max_position_embeddings``, as transformers computes
it (`sonar.models.rotary`): a sequence within the original context takes the short factors, a longer
prompt the long ones from its first chunk, and a generation that crosses the original context is
recomputed whole with the long ones (transformers' generate drops its cache there and prefills
again). Through the whole engine: chunked prefill, the prefix cache, short and long sequences in
one batch; greedy tokens equal transformers' and log-probabilities within 1e-4 (float32)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import sonar
from sonar.models.loader import load_model
from tests.engine.conftest import save_word_tokenizer, spread_weights
from tests.models.against import transformers_greedy

ORIGINAL = 32
MAX_POSITIONS = 128
#: whole-head rotary (16 dims, 8 frequencies): decode steps take the native fused loop on the CPU
LONGROPE = {
    "type": "longrope",
    "short_factor": [1.0, 1.1, 1.25, 1.5, 1.8, 2.0, 2.4, 3.0],
    "long_factor": [2.0, 3.0, 5.0, 8.0, 12.0, 16.0, 24.0, 32.0],
}
NEW_TOKENS = 20
#: float32 on both sides: the engine's log-probabilities against transformers' log-softmax
ATOL = 1e-4


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


def save_phi3(path: Path) -> Any:
    """Save a tiny random Phi-3 whose original context is 32 of its 128 positions, with a word
    tokenizer, at `path`; its transformers model."""
    from transformers import AutoModelForCausalLM, Phi3Config

    config = Phi3Config(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        original_max_position_embeddings=ORIGINAL,
        rope_scaling=LONGROPE,
        architectures=["Phi3ForCausalLM"],
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    torch.manual_seed(7)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    spread_weights(hf)
    hf.save_pretrained(str(path))
    save_word_tokenizer(path, config.vocab_size)
    return hf


@pytest.fixture(scope="module")
def phi3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("phi3-longrope")
    return path, save_phi3(path)


def prompts_by_kind() -> dict[str, list[int]]:
    """Within the original context to the end (short), crossing it while generating, at it exactly
    (the first decode crosses), and longer than it from the start (long)."""
    gen = torch.Generator().manual_seed(11)
    lengths = {"short": 9, "crossing": 20, "at_original": ORIGINAL, "long": 45}
    return {name: torch.randint(3, 384, (n,), generator=gen).tolist() for name, n in lengths.items()}


def assert_equals_transformers(hf: Any, prompt: list[int], out: Any, name: str, atol: float = ATOL) -> None:
    tokens, logits = transformers_greedy(hf, prompt, NEW_TOKENS)
    assert out.token_ids == tokens, name
    reference = torch.log_softmax(logits, dim=-1)[torch.arange(NEW_TOKENS), tokens]
    ours = torch.tensor([p.logprob for p in out.logprobs])
    torch.testing.assert_close(ours, reference, atol=atol, rtol=0, msg=name)


def test_the_model_serves_max_position_embeddings(phi3: tuple[Path, Any]) -> None:
    loaded = load_model(str(phi3[0]), dtype="float32")
    assert loaded.max_model_len == MAX_POSITIONS
    assert loaded.model.longrope_switch == ORIGINAL


@pytest.mark.anyio
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("async_scheduling", [False, True])
async def test_short_long_and_crossing_sequences_equal_transformers(
    phi3: tuple[Path, Any], async_scheduling: bool
) -> None:
    """All four prompts in one batch under a 16-token step budget (the long prompt prefills in
    chunks beside the others' decodes), twice: the second round's prompts hit the blocks the first
    cached, each under its own factor set (the crossing ones' recomputed blocks under the long).
    With async scheduling a crossing is found while the token before it is in flight."""
    path, hf = phi3
    prompts = prompts_by_kind()
    params = sonar.SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=2)
    async with sonar.open(
        str(path),
        dtype="float32",
        max_num_batched_tokens=16,
        max_num_seqs=8,
        num_gpu_blocks_override=40,
        async_scheduling=async_scheduling,
    ) as llm:
        assert llm.info.max_model_len == MAX_POSITIONS and llm.info.longrope_switch == ORIGINAL
        first = await llm.generate_many(list(prompts.values()), params)
        after_first = await llm.stats()
        second = await llm.generate_many(list(prompts.values()), params)
        stats = await llm.stats()
        assert stats.num_free_blocks == llm.info.num_blocks
    # the two crossing sequences were recomputed once each, every round
    assert after_first.num_preemptions == 2 and stats.num_preemptions == 4
    assert stats.prefix_hits > after_first.prefix_hits
    long_hit = second[list(prompts).index("long")].num_cached_tokens
    assert long_hit == 32  # the long prompt's two full blocks, cached under the long factors
    for outs in (first, second):
        for (name, prompt), out in zip(prompts.items(), outs):
            assert_equals_transformers(hf, prompt, out, name)


@pytest.mark.anyio
@pytest.mark.usefixtures("one_thread")
async def test_long_prompt_logprobs_equal_transformers(phi3: tuple[Path, Any]) -> None:
    """Every position of a 45-token prompt, prefilled in chunks of 16 with the long factors,
    equals transformers' forward pass of the whole prompt (which takes the long factors too)."""
    path, hf = phi3
    prompt = prompts_by_kind()["long"]
    params = sonar.SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    async with sonar.open(
        str(path), dtype="float32", max_num_batched_tokens=16, max_num_seqs=4, num_gpu_blocks_override=16
    ) as llm:
        out = await llm.generate(prompt, params)
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    ours = torch.tensor([p.logprob for p in out.prompt_logprobs[1:]])
    expected = ref[torch.arange(len(prompt) - 1), prompt[1:]]
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)
