"""Pooling models through the engine (`LLM.encode`): decoders served as embedders, against
sentence-transformers and transformers on the same weights; chunked prompts, the prefix cache,
refusals."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import sonar
from sonar.errors import InvalidRequestError
from sonar.pooling_params import PoolingParams
from tests.engine.conftest import TinyCheckpoint
from tests.models.tiny_pooling import write_sentence_transformers

pytestmark = pytest.mark.anyio

TEXTS = ["w5 w9 w13 w2", "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11", "w300 w7", "w42"]


def st_embeddings(path: Path, texts: list[str]) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu")
    return model.encode(texts, convert_to_tensor=True, batch_size=len(texts)).float()


def cosine(a: list[float], b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.tensor(a), b, dim=0))


@pytest.fixture(scope="module")
def qwen3_st(tiny_engine_checkpoints: dict[str, TinyCheckpoint], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny Qwen3 as two sentence-transformers folders: mean pooling, and last-token pooling
    (how Qwen3-Embedding pools), both normalized."""
    import shutil

    source = tiny_engine_checkpoints["qwen3"].path
    out = {}
    for mode in ("mean", "last"):
        path = tmp_path_factory.mktemp(f"st-qwen3-{mode}")
        shutil.copytree(source, path, dirs_exist_ok=True)
        write_sentence_transformers(path, mode, normalize=True)
        out[mode] = path
    return out


@pytest.mark.parametrize("mode", ["mean", "last"])
async def test_decoder_embeddings_equal_sentence_transformers(mode: str, qwen3_st: dict[str, Path]) -> None:
    path = qwen3_st[mode]
    expected = st_embeddings(path, TEXTS)
    async with sonar.open(str(path), dtype="float32", runner="pooling", num_gpu_blocks_override=64) as llm:
        assert llm.info.pooling is not None and llm.info.pooling.pooling_type == mode
        outs = [await llm.embed(text) for text in TEXTS]
    for out, ref in zip(outs, expected):
        vector = out.data.tolist()
        assert len(vector) == 64
        assert cosine(vector, ref) >= 0.9999
        assert math.isclose(sum(v * v for v in vector), 1.0, rel_tol=1e-5)


async def test_chunked_mean_pooling_equals_one_step(qwen3_st: dict[str, Path]) -> None:
    """A prompt spread over several steps (a 4-token chunk limit) pools what one step pools."""
    text = " ".join(f"w{i}" for i in range(5, 45))
    path = qwen3_st["mean"]
    expected = st_embeddings(path, [text])[0]
    async with sonar.open(
        str(path),
        dtype="float32",
        runner="pooling",
        num_gpu_blocks_override=64,
        max_num_batched_tokens=8,
        max_num_seqs=4,
        long_prefill_token_threshold=4,
    ) as llm:
        out = await llm.embed(text)
    assert cosine(out.data.tolist(), expected) >= 0.9999


@pytest.mark.parametrize(("mode", "reads_cache"), [("last", True), ("mean", False)])
async def test_prefix_cache_only_where_the_last_row_suffices(
    mode: str, reads_cache: bool, qwen3_st: dict[str, Path]
) -> None:
    """Last-token pooling reads cached blocks (it needs only the last row); mean pooling computes
    every row again. The vector is the same either way."""
    text = " ".join(f"w{i}" for i in range(5, 45))
    async with sonar.open(str(qwen3_st[mode]), dtype="float32", runner="pooling", num_gpu_blocks_override=64) as llm:
        first = await llm.embed(text)
        second = await llm.embed(text)
        stats = await llm.stats()
    assert (stats.prefix_hits > 0) == reads_cache
    assert cosine(second.data.tolist(), torch.tensor(first.data.tolist())) >= 0.99999


async def test_smollm2_convert_embed_equals_transformers() -> None:
    """The embedded model served with convert embed: its last token's final hidden state, normalized."""
    from transformers import AutoModel

    text = "The capital of France is Paris."
    async with sonar.open(dtype="float32", convert="embed", num_gpu_blocks_override=64, dequantize_weights=True) as llm:
        # the embedded model's converted checkpoint directory holds its tokenizer too
        path, tokenizer = llm.info.tokenizer_path, llm.tokenizer
        out = await llm.embed(text)
        token_rows = await llm.encode(text, PoolingParams(task="token_embed", normalize=False))
        with pytest.raises(InvalidRequestError, match="generates no text"):
            await llm.generate("Hello")
        with pytest.raises(InvalidRequestError, match="matryoshka"):
            await llm.embed(text, dimensions=8)
    hf = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        hidden = hf(ids).last_hidden_state[0]
    assert cosine(out.data.tolist(), hidden[-1]) >= 0.9999
    rows = torch.tensor(token_rows.data.tolist())
    assert token_rows.data.shape == [ids.shape[1], hidden.shape[1]]
    assert torch.allclose(rows, hidden, atol=2e-3, rtol=1e-3)


async def test_pooling_refusals(tiny_engine_checkpoints: dict[str, TinyCheckpoint]) -> None:
    path = tiny_engine_checkpoints["qwen3"].path
    async with sonar.open(str(path), dtype="float32", num_gpu_blocks_override=64) as llm:
        assert llm.info.pooling is None
        with pytest.raises(InvalidRequestError, match="not a pooling model"):
            await llm.embed("w1 w2")
    async with sonar.open(
        str(path), dtype="float32", runner="pooling", num_gpu_blocks_override=64, max_model_len=16
    ) as llm:
        long = " ".join(f"w{i}" for i in range(1, 30))
        with pytest.raises(InvalidRequestError, match="maximum context length is 16") as info:
            await llm.embed(long)
        assert info.value.code == "context_length_exceeded"
        kept = await llm.embed(long, truncate_prompt_tokens=-1)
        assert kept.num_prompt_tokens == 16
        kept = await llm.embed(list(range(1, 30)), truncate_prompt_tokens=5)
        assert kept.prompt_token_ids == list(range(25, 30))
        with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens"):
            await llm.embed(long, truncate_prompt_tokens=0)
        with pytest.raises(InvalidRequestError, match="'classify' task"):
            await llm.classify("w1")
        with pytest.raises(InvalidRequestError, match="use_activation applies"):
            await llm.encode("w1", PoolingParams(task="embed", use_activation=True))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"runner": "draft"}, "speculative-config"),
        ({"convert": "rewards"}, "not supported"),
        ({"runner": "generate", "convert": "reward"}, "cannot run with runner generate"),
        ({"runner": "generate", "convert": "embed"}, "cannot run with runner generate"),
        ({"runner": "pooling", "enable_lora": True}, "enable_lora is not supported with a pooling model"),
        ({"pooler_config": {"pooling_type": "max"}}, "unknown pooling_type"),
        ({"pooler_config": {"pooling": "mean"}}, "pooler-config"),
        ({"hf_overrides": {"model_type": "bert"}}, "model_type"),
    ],
)
def test_pooling_flags_refused(args: dict[str, Any], message: str) -> None:
    from sonar.engine.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig.from_args(**args)


async def test_a_worker_crash_mid_prompt_gives_the_same_embeddings(qwen3_st: dict[str, Path]) -> None:
    """The worker dies on the second step, inside the chunked prompts of mean-pooled requests: the
    restarted worker computes them again from their first token, and the vectors are those of
    sentence-transformers."""
    texts = [" ".join(f"w{i + k}" for i in range(5, 37)) for k in range(3)]
    path = qwen3_st["mean"]
    expected = st_embeddings(path, texts)
    async with sonar.open(
        str(path),
        dtype="float32",
        runner="pooling",
        num_gpu_blocks_override=64,
        max_num_batched_tokens=8,
        max_num_seqs=4,
        fault_injection="raise@step=2",
    ) as llm:
        async with anyio.create_task_group() as tg:
            results: dict[int, Any] = {}

            async def one(i: int) -> None:
                results[i] = await llm.embed(texts[i])

            for i in range(len(texts)):
                tg.start_soon(one, i)
        worker = next(c for c in llm.tree().children if c.name == "worker")
        assert worker.restarts == 1 and worker.last_exit == "crash"
    for i, ref in enumerate(expected):
        assert cosine(results[i].data.tolist(), ref) >= 0.9999


async def test_pooling_type_all_serves_one_row_per_token(tiny_engine_checkpoints: dict[str, TinyCheckpoint]) -> None:
    checkpoint = tiny_engine_checkpoints["qwen3"]
    ids = [5, 9, 13, 2, 7]
    async with sonar.open(
        str(checkpoint.path),
        dtype="float32",
        runner="pooling",
        pooler_config={"pooling_type": "ALL", "normalize": False},
        num_gpu_blocks_override=64,
    ) as llm:
        assert llm.info.pooling is not None and llm.info.pooling.tasks == ["token_embed"]
        rows = await llm.encode(ids)
        with pytest.raises(InvalidRequestError, match="pooling type is ALL"):
            await llm.embed(ids)
    with torch.no_grad():
        expected = checkpoint.hf.model(torch.tensor([ids])).last_hidden_state[0]
    assert rows.data.shape == [5, 64]
    assert torch.allclose(torch.tensor(rows.data.tolist()), expected, atol=1e-4)


async def test_a_sentence_transformers_max_seq_length_is_the_default_context(
    qwen3_st: dict[str, Path], tmp_path: Path
) -> None:
    """sentence-transformers cuts inputs to its folder's max_seq_length (128 here, of 256 positions):
    that is the model's context unless --max-model-len says otherwise."""
    async with sonar.open(str(qwen3_st["mean"]), dtype="float32", num_gpu_blocks_override=64, runner="pooling") as llm:
        assert llm.info.max_model_len == 128
    async with sonar.open(
        str(qwen3_st["mean"]), dtype="float32", num_gpu_blocks_override=64, runner="pooling", max_model_len=200
    ) as llm:
        assert llm.info.max_model_len == 200
