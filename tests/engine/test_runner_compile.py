"""The engine at ``-O3`` on the CPU: the runner steps through the compiled forward pass
(`sonar.engine.compile`), its greedy tokens and logprobs still equal transformers', and the
compiled code lands in ``SONAR_CACHE_ROOT``, which a second engine loads instead of compiling.

The tiny Qwen3 checkpoint (q/k norms, tied embeddings) in float32, batched prompts of 3 to 64
tokens with a 16-token step budget, so steps mix prefill chunks and decodes: both of the compiled
graphs (one token, many tokens) serve them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import sonar
from tests.conftest import fresh_cache_root
from tests.engine.conftest import TinyCheckpoint
from tests.engine.test_correctness import (
    TINY_LOGPROB_ATOL,
    _assert_engine_idle,
    _assert_logprobs_match,
    _greedy,
    _random_prompts,
    _run_batch,
    _transformers_greedy,
)

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("one_thread")]

NEW_TOKENS = 12
LOGPROBS = 3


@pytest.fixture
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh SONAR_CACHE_ROOT (the native kernels shared); compiling points the process's
    inductor cache into it, which setting the variable here first lets monkeypatch restore
    afterwards."""
    monkeypatch.setenv("SONAR_CACHE_ROOT", str(fresh_cache_root(tmp_path)))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "unused"))
    monkeypatch.delenv("SONAR_FORCE_AOT_LOAD", raising=False)
    return tmp_path


async def test_compiled_engine_equals_transformers_and_caches(
    cache_root: Path, tiny_engine_checkpoints: dict[str, TinyCheckpoint], monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny = tiny_engine_checkpoints["qwen3"]
    prompts = _random_prompts(tiny.hf.config.vocab_size, [3, 17, 40, 9, 33, 64], seed=3)
    args = dict(num_gpu_blocks_override=64, max_num_batched_tokens=16, max_num_seqs=8, optimization_level=3)
    outs, stats, info = await _run_batch(str(tiny.path), prompts, _greedy(NEW_TOKENS, LOGPROBS), **args)
    assert info.startup_seconds["compile"] > 0
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_logprobs = _transformers_greedy(tiny.hf, prompt, NEW_TOKENS)
        assert out.token_ids == ref_tokens
        _assert_logprobs_match(out, ref_logprobs, LOGPROBS, TINY_LOGPROB_ATOL)
    _assert_engine_idle(stats, info)

    manifests = list((cache_root / "torch_compile").glob("*/manifest.json"))
    assert len(manifests) == 1
    assert json.loads(manifests[0].read_text())["fxgraph_miss"] > 0

    # a second engine on the same cache root must load every graph: forced loading fails on a miss
    monkeypatch.setenv("SONAR_FORCE_AOT_LOAD", "1")
    again, _, _ = await _run_batch(str(tiny.path), prompts, _greedy(NEW_TOKENS, LOGPROBS), **args)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    assert json.loads(manifests[0].read_text())["fxgraph_miss"] == 0


async def test_forced_load_on_an_empty_cache_fails_to_start(
    cache_root: Path, tiny_engine_checkpoints: dict[str, TinyCheckpoint], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SONAR_FORCE_AOT_LOAD", "1")
    with pytest.raises(Exception, match="SONAR_FORCE_AOT_LOAD=1 but the compile cache has no artifacts"):
        async with sonar.open(
            str(tiny_engine_checkpoints["qwen3"].path),
            dtype="float32",
            num_gpu_blocks_override=16,
            optimization_level=3,
        ):
            pass
