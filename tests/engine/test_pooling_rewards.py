"""Reward models (``--convert reward``), token classifiers and a sentence-transformers folder's
``do_lower_case`` through the engine (`sonar.open`), against transformers and
sentence-transformers on the same tiny random weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import sonar
from sonar.engine.llm import PoolingOutput
from sonar.errors import InvalidRequestError
from sonar.pooling_params import PoolingParams
from tests.models.tiny_pooling import (
    save_tiny_bert,
    save_tiny_decoder_classifier,
    save_tiny_qwen3_reranker,
    write_sentence_transformers,
)

pytestmark = pytest.mark.anyio

ENGINE = dict(dtype="float32", max_num_seqs=4, num_gpu_blocks_override=64)
CHUNKED = dict(ENGINE, max_num_batched_tokens=8, long_prefill_token_threshold=4)
"""Prompts of more than 8 tokens take several steps: the rows of each step are kept."""
PROMPTS = [[5, 9, 13, 2], [7], list(range(3, 40))]
TEXTS = ["the capital of france is paris", "a cat sat on the mat", "water"]


def rows(out: PoolingOutput) -> torch.Tensor:
    return torch.tensor(out.data.tolist())


async def test_causal_lm_rewards_are_its_hidden_states_per_token(tmp_path: Path) -> None:
    """A Qwen3ForCausalLM with --convert reward: every token's final hidden state, not normalized
    (vLLM's reward pooler), through chunked prompts."""
    hf = save_tiny_qwen3_reranker(tmp_path, tie_word_embeddings=False)
    async with sonar.open(str(tmp_path), convert="reward", **CHUNKED) as llm:
        info = llm.info.pooling
        assert info is not None and info.reward and info.tasks == ["token_embed"]
        assert (info.pooling_type, info.normalize) == ("all", False)
        ours = [rows(await llm.reward(p)) for p in PROMPTS]
        with pytest.raises(InvalidRequestError, match="'embed' task"):
            await llm.embed(PROMPTS[0])
    for ids, got in zip(PROMPTS, ours):
        with torch.no_grad():
            expected = hf.model(torch.tensor([ids])).last_hidden_state[0]
        assert got.shape == expected.shape
        assert (got - expected).abs().max() < 1e-4


async def test_sequence_classifier_rewards_are_its_score_per_token(tmp_path: Path) -> None:
    """A Qwen3ForSequenceClassification reward model (one label, as Skywork-Reward): its score head
    on every token, raw logits; the last row is transformers' reward of the sequence."""
    hf = save_tiny_decoder_classifier(tmp_path, "qwen3", num_labels=1)
    async with sonar.open(str(tmp_path), convert="reward", **CHUNKED) as llm:
        info = llm.info.pooling
        assert info is not None and info.tasks == ["token_classify"] and not info.use_activation
        ours = [rows(await llm.reward(p)) for p in PROMPTS]
        activated = rows(await llm.encode(PROMPTS[0], PoolingParams(task="token_classify", use_activation=True)))
        with pytest.raises(InvalidRequestError, match="'classify' task"):
            await llm.classify(PROMPTS[0])
    for ids, got in zip(PROMPTS, ours):
        with torch.no_grad():
            expected = hf.score(hf.model(torch.tensor([ids])).last_hidden_state)[0]
            reward = hf(torch.tensor([ids])).logits[0]
        assert got.shape == (len(ids), 1)
        assert (got - expected).abs().max() < 1e-4
        assert (got[-1] - reward).abs().max() < 1e-4
    assert (activated - ours[0].sigmoid()).abs().max() < 1e-6


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
async def test_encoder_token_classifier_equals_transformers(kind: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    hf = save_tiny_bert(tmp_path, kind, num_labels=3, head="token")
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    async with sonar.open(str(tmp_path), **ENGINE) as llm:  # a token classifier pools by itself
        info = llm.info.pooling
        assert info is not None and info.tasks == ["token_classify"] and info.pooling_type == "all"
        assert info.labels == ["LABEL_0", "LABEL_1", "LABEL_2"] and not info.reward
        probs = [rows(await llm.encode(t)) for t in TEXTS]
        logits = rows(await llm.encode(TEXTS[0], PoolingParams(task="token_classify", use_activation=False)))
        with pytest.raises(InvalidRequestError, match="token classifier"):
            await llm.classify(TEXTS[0])
        with pytest.raises(InvalidRequestError, match="--convert reward"):
            await llm.reward(TEXTS[0])
    for text, got in zip(TEXTS, probs):
        with torch.no_grad():
            expected = hf(**tokenizer(text, return_tensors="pt")).logits[0]
        assert got.shape == expected.shape
        assert (got - expected.softmax(-1)).abs().max() < 1e-5
        if text == TEXTS[0]:
            assert (logits - expected).abs().max() < 1e-4


async def test_decoder_token_classifier_equals_transformers(tmp_path: Path) -> None:
    """A Qwen3ForTokenClassification (a ``score`` head with a bias), through chunked prompts."""
    hf = save_tiny_decoder_classifier(tmp_path, "qwen3", num_labels=2, head="token")
    async with sonar.open(str(tmp_path), **CHUNKED) as llm:
        probs = [rows(await llm.encode(p, PoolingParams(task="token_classify"))) for p in PROMPTS]
    for ids, got in zip(PROMPTS, probs):
        with torch.no_grad():
            expected = hf(torch.tensor([ids])).logits[0].softmax(-1)
        assert (got - expected).abs().max() < 1e-5


async def test_do_lower_case_applies_to_text(tmp_path: Path) -> None:
    """A sentence-transformers folder whose tokenizer keeps case (a capitalized word is [UNK]) and
    whose ``sentence_bert_config.json`` says ``do_lower_case``: the text is lowercased first, as
    sentence-transformers does."""
    from sentence_transformers import SentenceTransformer

    save_tiny_bert(tmp_path, "bert", lower_case=False)
    write_sentence_transformers(tmp_path, "mean", normalize=True, do_lower_case=True)
    texts = ["The Capital of France is PARIS", "A Cat sat on the Mat"]
    expected = SentenceTransformer(str(tmp_path), device="cpu").encode(texts, convert_to_tensor=True)
    async with sonar.open(str(tmp_path), **ENGINE) as llm:
        assert llm.info.pooling is not None and llm.info.pooling.lower_case
        assert llm.tokenizer.unk_token_id in llm.tokenizer(texts[0]).input_ids  # as written, words are unknown
        outs = [await llm.embed(t) for t in texts]
    assert all(llm.tokenizer.unk_token_id not in o.prompt_token_ids for o in outs)
    ours = torch.tensor([o.data.tolist() for o in outs])
    assert torch.nn.functional.cosine_similarity(ours, expected.float(), dim=1).min() >= 0.9999
