"""Encoders, cross-encoders and classifiers through the engine (`sonar.open`, `LLM.encode`), against
sentence-transformers and transformers on the same tiny random weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import sonar
from sonar.errors import InvalidRequestError
from sonar.pooling_params import PoolingParams
from tests.models.tiny_pooling import (
    RERANKER_OVERRIDES,
    save_tiny_bert,
    save_tiny_decoder_classifier,
    save_tiny_qwen3_reranker,
    save_tiny_sentence_transformer,
)

pytestmark = pytest.mark.anyio

TEXTS = [
    "the capital of france is paris",
    "a cat sat on the mat",
    "water",
    "gravity is the force that makes the river go down to the sea and the man see it every day",
]
PAIRS = [
    ("what is the capital of france", "paris is the capital of france"),
    ("what is the capital of france", "a cat sat on the mat"),
    ("where does the river go", "the river goes down to the sea"),
]
ENGINE = dict(dtype="float32", max_num_seqs=8)


async def embed_all(llm: Any, texts: list[str]) -> list[list[float]]:
    """All at once, so the engine batches them (encoders: whole prompts of several lengths in one step)."""
    out: list[Any] = [None] * len(texts)

    async def one(i: int) -> None:
        out[i] = (await llm.embed(texts[i])).data.tolist()

    async with anyio.create_task_group() as tg:
        for i in range(len(texts)):
            tg.start_soon(one, i)
    return out


@pytest.mark.parametrize("pooling", ["mean", "cls"])
async def test_bert_embeddings_equal_sentence_transformers(pooling: str, tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    save_tiny_sentence_transformer(tmp_path, pooling=pooling, normalize=True)
    expected = SentenceTransformer(str(tmp_path), device="cpu").encode(TEXTS, convert_to_tensor=True)
    async with sonar.open(str(tmp_path), **ENGINE) as llm:  # an encoder pools by itself (runner auto)
        info = llm.info.pooling
        assert info is not None and (info.pooling_type, info.causal, info.normalize) == (pooling, False, True)
        ours = await embed_all(llm, TEXTS)
    cosines = torch.nn.functional.cosine_similarity(torch.tensor(ours), expected.float(), dim=1)
    assert cosines.min() >= 0.9999


@pytest.mark.parametrize("kind", ["xlm-roberta", "roberta"])
async def test_roberta_family_mean_pooling_equals_transformers(kind: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    hf = save_tiny_bert(tmp_path, kind)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    async with sonar.open(str(tmp_path), pooler_config={"pooling_type": "MEAN", "normalize": False}, **ENGINE) as llm:
        ours = await embed_all(llm, TEXTS)
    for text, vector in zip(TEXTS, ours):
        ids = tokenizer(text, return_tensors="pt").input_ids
        with torch.no_grad():
            expected = hf(ids).last_hidden_state[0].mean(0)
        assert torch.allclose(torch.tensor(vector), expected, atol=1e-4)


async def test_cross_encoder_scores_equal_sentence_transformers(tmp_path: Path) -> None:
    """A BertForSequenceClassification with one label, given text pairs (token types 0, then 1):
    the sigmoid of its logit, as sentence-transformers' CrossEncoder scores it."""
    from sentence_transformers import CrossEncoder

    save_tiny_bert(tmp_path, "bert", num_labels=1)
    expected = CrossEncoder(str(tmp_path), device="cpu").predict(PAIRS)
    async with sonar.open(str(tmp_path), **ENGINE) as llm:
        info = llm.info.pooling
        assert info is not None and info.tasks == ["classify"] and info.num_labels == 1
        scores = []
        for query, document in PAIRS:
            encoded = llm.tokenizer(query, document)
            pair_start = encoded.token_type_ids.index(1)
            out = await llm.encode(encoded.input_ids, PoolingParams(task="classify", pair_start=pair_start))
            scores.append(out.data.tolist()[0])
        with pytest.raises(InvalidRequestError, match="'embed' task"):
            await llm.embed("water")
    assert torch.allclose(torch.tensor(scores), torch.tensor(expected).float(), atol=1e-4)


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
async def test_sequence_classifier_probabilities_equal_transformers(kind: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    hf = save_tiny_bert(tmp_path, kind, num_labels=3)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    async with sonar.open(str(tmp_path), **ENGINE) as llm:
        assert llm.info.pooling is not None and llm.info.pooling.labels == ["LABEL_0", "LABEL_1", "LABEL_2"]
        probs = [(await llm.classify(text)).data.tolist() for text in TEXTS]
        logits = (await llm.classify(TEXTS[0], use_activation=False)).data.tolist()
    for text, p in zip(TEXTS, probs):
        with torch.no_grad():
            expected = hf(**tokenizer(text, return_tensors="pt")).logits[0]
        assert torch.allclose(torch.tensor(p), expected.softmax(-1), atol=1e-5)
        if text == TEXTS[0]:
            assert torch.allclose(torch.tensor(logits), expected, atol=1e-4)


async def test_encoder_prompt_longer_than_its_positions_is_refused(tmp_path: Path) -> None:
    save_tiny_sentence_transformer(tmp_path, pooling="cls")
    long = " ".join(["water"] * 200)
    async with sonar.open(str(tmp_path), **ENGINE) as llm:
        assert llm.info.max_model_len == 128
        with pytest.raises(InvalidRequestError, match="maximum context length is 128"):
            await llm.embed(long)
        out = await llm.embed(long, truncate_prompt_tokens=-1)
        assert out.num_prompt_tokens == 128
        assert out.prompt_token_ids[-1] == llm.tokenizer.sep_token_id  # the tokenizer cut it, keeping [SEP]


async def test_decoder_classifier_equals_transformers(tmp_path: Path) -> None:
    """A Qwen3ForSequenceClassification: its score head over the last token, two labels."""
    hf = save_tiny_decoder_classifier(tmp_path, "qwen3", num_labels=2)
    prompts = [[5, 9, 13, 2], [7], list(range(3, 40))]
    async with sonar.open(str(tmp_path), num_gpu_blocks_override=64, **ENGINE) as llm:
        probs = [(await llm.classify(p)).data.tolist() for p in prompts]
    for ids, p in zip(prompts, probs):
        with torch.no_grad():
            expected = hf(torch.tensor([ids])).logits[0].softmax(-1)
        assert torch.allclose(torch.tensor(p), expected, atol=1e-5)


async def test_qwen3_reranker_served_with_hf_overrides(tmp_path: Path) -> None:
    """An original Qwen3-Reranker (a causal LM) with vLLM's overrides: the score is the probability
    of "yes" against "no" after the prompt."""
    hf = save_tiny_qwen3_reranker(tmp_path)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    no, yes = tokenizer.convert_tokens_to_ids(["no", "yes"])
    prompts = [[5, 9, 13, 2], list(range(3, 30))]
    async with sonar.open(str(tmp_path), hf_overrides=RERANKER_OVERRIDES, num_gpu_blocks_override=64, **ENGINE) as llm:
        assert llm.info.pooling is not None and llm.info.pooling.num_labels == 1
        scores = [(await llm.classify(p)).data.tolist()[0] for p in prompts]
    for ids, score in zip(prompts, scores):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1, [no, yes]]
        assert abs(score - float(logits.softmax(-1)[1])) < 1e-5


async def test_an_encoder_refuses_generation_and_runner_generate(tmp_path: Path) -> None:
    save_tiny_sentence_transformer(tmp_path)
    async with sonar.open(str(tmp_path), **ENGINE) as llm:
        with pytest.raises(InvalidRequestError, match="generates no text"):
            await llm.generate("water")
    with pytest.raises(Exception, match="cannot run with --runner generate"):
        async with sonar.open(str(tmp_path), runner="generate", **ENGINE):
            pass
