"""``--kv-cache-dtype``: fp8 (e4m3, scale 1.0) on the CPU reference path, and what it does to memory.

SmolLM2-135M (float32 weights, the fastest CPU dtype for a short test) generates greedily with a
float32 KV cache and with an fp8 one: the write quantizes, attention dequantizes what it reads.
The greedy text is not always identical: e4m3 keeps 3 mantissa bits, and at a near-tie the choice
flips. Which prompts flip, and where, depends on the CPU's float arithmetic: of the six prompts
below, three agreed on all 20 tokens on one AMD EPYC and the others for 13, 10 and 2; on an Intel
Xeon the 13 became 18. So the test holds every step up to a prompt's first difference (where both
runs saw the same tokens) to close logits, the difference itself to a choice the float32 run
almost made (its two logits closer than that error bound), and most tokens to agreeing.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sonar.engine.config import EngineConfig
from sonar.engine.runner import ModelRunner
from sonar.kernels.attention import AttentionMetadata, allocate_kv_caches
from sonar.kernels.reference import FP8_DTYPE

BLOCK = 16
NEW_TOKENS = 20
PROMPTS = [
    "The capital of France is",
    "Water boils at",
    "def fibonacci(n):",
    "List three colors:",
    "The quick brown fox",
    "1, 2, 3, 4,",
]
FP8_LOGIT_RTOL = 0.15
"""Of the largest |logit| of the prompt's steps (15-42 here). Measured while the tokens agree:
1.1 to 3.4, at most 10 % of that (2.1 on logits up to 21). At a first difference the float32
logits of the two tokens were 0.02 to 0.43 apart."""

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def smollm2() -> Any:
    from sonar.models.loader import load_model

    return load_model(None, dtype="float32", dequantize_weights=True)


def greedy(loaded: Any, prompts: list[list[int]], kv_dtype: torch.dtype) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens of a batch (one prefill step, then decode steps) and the logits of every step."""
    model = loaded.model
    blocks_per_seq = -(-(max(map(len, prompts)) + NEW_TOKENS) // BLOCK)
    caches = allocate_kv_caches(
        model.num_layers, 1 + blocks_per_seq * len(prompts), BLOCK, model.num_kv_heads, model.head_dim, kv_dtype
    )
    tables = [list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)) for i in range(len(prompts))]
    lens = [len(p) for p in prompts]
    ids, positions, q_lens = sum(prompts, []), [i for n in lens for i in range(n)], lens
    out: list[list[int]] = [[] for _ in prompts]
    logits_seen = []
    with torch.inference_mode():
        for _ in range(NEW_TOKENS):
            meta = AttentionMetadata.build(q_lens, lens, tables, BLOCK)
            hidden = model(torch.tensor(ids), torch.tensor(positions), caches, meta)
            last = torch.tensor(q_lens).cumsum(0) - 1
            logits = model.compute_logits(hidden[last])
            logits_seen.append(logits)
            tokens = logits.argmax(-1).tolist()
            for seq, token in zip(out, tokens):
                seq.append(token)
            ids, positions, q_lens = tokens, lens, [1] * len(prompts)
            lens = [n + 1 for n in lens]
    return out, torch.stack(logits_seen)


def test_fp8_kv_cache_gives_the_same_greedy_text(smollm2: Any) -> None:
    tok = smollm2.load_tokenizer()
    prompts = [tok(p).input_ids for p in PROMPTS]
    auto, auto_logits = greedy(smollm2, prompts, smollm2.dtype)
    fp8, fp8_logits = greedy(smollm2, prompts, FP8_DTYPE)
    agreeing = 0
    for i, (a, f) in enumerate(zip(auto, fp8)):
        same = next((step for step, (x, y) in enumerate(zip(a, f)) if x != y), NEW_TOKENS)
        agreeing += same
        last = min(same, NEW_TOKENS - 1)
        want = auto_logits[: last + 1, i]
        bound = FP8_LOGIT_RTOL * want.abs().max()
        diff = (fp8_logits[: last + 1, i] - want).abs().max()
        assert diff < bound, (i, float(diff))
        if same < NEW_TOKENS:  # a near-tie in the float32 run, or fp8 changed more than rounding
            margin = auto_logits[same, i, a[same]] - auto_logits[same, i, f[same]]
            assert margin < bound, (i, same, float(margin), tok.decode(f))
    assert agreeing >= NEW_TOKENS * len(prompts) // 2, [tok.decode(t) for t in fp8]


def test_fp8_doubles_the_blocks_of_the_same_memory(tiny_engine_checkpoints) -> None:
    path = str(tiny_engine_checkpoints["llama3"].path)
    runners = {
        dtype: ModelRunner(
            EngineConfig.from_args(path, dtype="bfloat16", kv_cache_memory_bytes="1MiB", kv_cache_dtype=dtype)
        )
        for dtype in ("auto", "fp8")
    }
    auto, fp8 = runners["auto"], runners["fp8"]
    assert auto.kv_caches[0].dtype == torch.bfloat16 and fp8.kv_caches[0].dtype == FP8_DTYPE
    assert fp8.num_blocks == 2 * auto.num_blocks
    assert fp8.info.kv_cache_memory_bytes == auto.info.kv_cache_memory_bytes == 2**20


def test_kv_cache_dtype_reaches_the_engine_and_offloading_is_refused_with_fp8() -> None:
    assert EngineConfig.from_args(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match="fp8_e5m2 is not supported"):
        EngineConfig.from_args(kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="KV offloading with kv_cache_dtype fp8 is not supported yet"):
        EngineConfig.from_args(kv_cache_dtype="fp8", kv_offloading_size=1.0)
