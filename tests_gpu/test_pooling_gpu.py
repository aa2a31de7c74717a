"""Pooling models on the GPU: an encoder's bidirectional attention and a decoder embedder through
the CUDA runner (Triton kernels for the decoder), against sentence-transformers and transformers
on the CPU (float32, so a difference is the engine's, not the dtype's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import sonar
from sonar.pooling_params import PoolingParams
from tests.models.tiny_pooling import save_tiny_bert, save_tiny_sentence_transformer

pytestmark = pytest.mark.anyio

TEXTS = ["the capital of france is paris", "a cat sat on the mat", "water", "the river goes down to the sea"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _embed_all(llm: Any, texts: list[str]) -> torch.Tensor:
    out: list[list[float]] = [[] for _ in texts]

    async def one(i: int) -> None:
        out[i] = (await llm.embed(texts[i])).data.tolist()

    async with anyio.create_task_group() as tg:
        for i in range(len(texts)):
            tg.start_soon(one, i)
    return torch.tensor(out)


async def test_encoder_embeddings_and_cross_encoder_scores(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from sentence_transformers import CrossEncoder, SentenceTransformer

    embedder, scorer = tmp_path / "embedder", tmp_path / "scorer"
    save_tiny_sentence_transformer(embedder, pooling="mean")
    save_tiny_bert(scorer, "bert", num_labels=1)
    expected = SentenceTransformer(str(embedder), device="cpu").encode(TEXTS, convert_to_tensor=True).float()
    pairs = [(TEXTS[0], TEXTS[1]), (TEXTS[2], TEXTS[3])]
    expected_scores = torch.tensor(CrossEncoder(str(scorer), device="cpu").predict(pairs)).float()
    monkeypatch.setenv("SONAR_DEVICE", "cuda")
    async with sonar.open(str(embedder), dtype="float32") as llm:
        assert llm.info.device == "cuda"
        ours = await _embed_all(llm, TEXTS)
    assert torch.nn.functional.cosine_similarity(ours, expected, dim=1).min() >= 0.9999
    async with sonar.open(str(scorer), dtype="float32") as llm:
        scores = []
        for query, document in pairs:
            encoded = llm.tokenizer(query, document)
            params = PoolingParams(task="classify", pair_start=encoded.token_type_ids.index(1))
            scores.append((await llm.encode(encoded.input_ids, params)).data.tolist()[0])
    assert torch.allclose(torch.tensor(scores), expected_scores, atol=1e-4)


async def test_smollm2_convert_embed_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SONAR_DEVICE", "cuda")
    text = "The capital of France is Paris."
    async with sonar.open(dtype="float32", convert="embed", dequantize_weights=True) as llm:
        vector = torch.tensor((await llm.embed(text)).data.tolist())
        model_dir, tokenizer = llm.info.tokenizer_path, llm.tokenizer
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        last = hf(tokenizer(text, return_tensors="pt").input_ids).last_hidden_state[0, -1]
    assert torch.nn.functional.cosine_similarity(vector, last, dim=0) >= 0.9999
