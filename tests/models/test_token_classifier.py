"""Token classifiers (`sonar.models.token_classifier`) loaded from tiny transformers checkpoints, and
what `pooling_info` makes of them and of ``--convert reward``: the tasks served, and every
combination it cannot serve refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sonar.models.errors import ModelLoadError
from sonar.models.loader import load_model
from sonar.models.pooler import pooling_info, wants_pooling
from sonar.pooling_params import PoolerConfig
from tests.models.test_classifier import last_hidden
from tests.models.tiny_pooling import (
    save_tiny_bert,
    save_tiny_decoder_classifier,
    save_tiny_qwen3_reranker,
    write_sentence_transformers,
)


def info_of(path: Path, convert: str = "auto", **pooler: Any) -> Any:
    loaded = load_model(str(path), dtype="float32", convert="none" if convert == "auto" else convert)
    assert wants_pooling(type(loaded.model), "auto", convert)
    return pooling_info(loaded.model, loaded.config, loaded.model_dir, convert, PoolerConfig.parse(pooler))


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_decoder_head_on_every_token_equals_transformers(family: str, tmp_path: Path) -> None:
    hf = save_tiny_decoder_classifier(tmp_path, family, num_labels=3, head="token")
    loaded = load_model(str(tmp_path), dtype="float32")
    model = loaded.model
    assert loaded.architecture == hf.config.architectures[0] and loaded.is_pooling_model
    assert model.per_token and model.num_labels == 3 and model.score.bias is not None
    ids = [4, 8, 15, 16, 23, 42]
    # every row: the prompt as single-token prefixes would recompute; one sequence's last rows instead
    hidden = torch.stack([last_hidden(loaded, [ids[: i + 1]])[0] for i in range(len(ids))])
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0]
    assert (model.classify(hidden) - expected).abs().max() < 1e-4


def test_token_classifier_info(tmp_path: Path) -> None:
    save_tiny_bert(tmp_path, "roberta", num_labels=2, head="token", id2label={0: "O", 1: "PER"})
    info = info_of(tmp_path)
    assert (info.tasks, info.pooling_type, info.labels) == (["token_classify"], "all", ["O", "PER"])
    assert info.use_activation and not info.reward and not info.causal
    assert "token classifier" in info.why_not["classify"]
    embed = info_of(tmp_path, "embed")  # its encoder's hidden states
    assert embed.tasks == ["embed", "token_embed"] and embed.pooling_type == "cls"
    reward = info_of(tmp_path, "reward")  # its head's raw logits per token
    assert reward.tasks == ["token_classify"] and reward.reward and not reward.use_activation


def test_reward_info(tmp_path: Path) -> None:
    save_tiny_qwen3_reranker(tmp_path)
    write_sentence_transformers(tmp_path, "last", normalize=True)  # a reward model ignores Normalize
    info = info_of(tmp_path, "reward")
    assert (info.tasks, info.pooling_type, info.normalize, info.reward) == (["token_embed"], "all", False, True)
    assert "reward model" in info.why_not["embed"]
    assert info_of(tmp_path, "reward", normalize=True).normalize


def test_refusals_name_what_is_wrong(tmp_path: Path) -> None:
    ner, cross, lm = tmp_path / "ner", tmp_path / "cross", tmp_path / "lm"
    save_tiny_bert(ner, "bert", num_labels=2, head="token")
    save_tiny_bert(cross, "bert", num_labels=1)
    save_tiny_qwen3_reranker(lm)
    with pytest.raises(ModelLoadError, match="--convert classify: BertForTokenClassification classifies each token"):
        info_of(ner, "classify")
    with pytest.raises(ModelLoadError, match="pooling_type MEAN: BertForTokenClassification"):
        info_of(ner, pooling_type="mean")
    with pytest.raises(ModelLoadError, match="head reads the first token only"):
        info_of(cross, "reward")
    assert info_of(cross).why_not["token_classify"] == "BertForSequenceClassification classifies whole sequences"
    decoder = tmp_path / "decoder"
    save_tiny_decoder_classifier(decoder, "qwen3", num_labels=1)
    assert info_of(decoder).why_not["token_classify"].endswith("its head's logits per token: --convert reward")
    with pytest.raises(ModelLoadError, match="pooling_type LAST: --convert reward"):
        info_of(lm, "reward", pooling_type="LAST")
    with pytest.raises(ModelLoadError, match="dimensions applies to embeddings, not to --convert reward"):
        info_of(lm, "reward", dimensions=64)
    with pytest.raises(ModelLoadError, match="use_activation applies to classifiers, not to --convert reward"):
        info_of(lm, "reward", use_activation=True)
    with pytest.raises(ModelLoadError, match="normalize applies to embeddings, not to BertForTokenClassification"):
        info_of(ner, normalize=False)
    with pytest.raises(ModelLoadError, match="--convert reward makes a pooling model"):
        wants_pooling(type(load_model(str(lm), dtype="float32").model), "generate", "reward")
    write_sentence_transformers(lm, "last", normalize=False)
    (lm / "sentence_bert_config.json").write_text('{"do_lower_case": "yes"}')
    with pytest.raises(ModelLoadError, match="do_lower_case must be true or false"):
        info_of(lm, "embed")


def test_do_lower_case_is_for_embedding_models(tmp_path: Path) -> None:
    """sentence-transformers' SentenceTransformer lowercases with ``do_lower_case``; its CrossEncoder
    keeps case whatever the folder says (checked against it), so a classifier keeps case."""
    from sentence_transformers import CrossEncoder

    save_tiny_bert(tmp_path, "bert", num_labels=1, lower_case=False)
    write_sentence_transformers(tmp_path, "cls", normalize=False, do_lower_case=True)
    assert info_of(tmp_path, "embed").lower_case
    assert not info_of(tmp_path).lower_case
    pair = ("What is the Capital", "PARIS is the capital")
    lowered = tuple(t.lower() for t in pair)
    kept, lower = CrossEncoder(str(tmp_path), device="cpu").predict([pair, lowered])
    assert abs(kept - lower) > 1e-3  # the case matters to this tokenizer, and CrossEncoder kept it
