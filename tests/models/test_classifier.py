"""Decoder classifiers and the Qwen3-Reranker conversion against transformers on tiny random checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sonar.kernels.attention import AttentionMetadata, allocate_kv_caches
from sonar.models import config_cache
from sonar.models.errors import ModelLoadError
from sonar.models.loader import LoadedModel, load_model
from tests.models.tiny_pooling import RERANKER_OVERRIDES, save_tiny_decoder_classifier, save_tiny_qwen3_reranker

TEXTS = ["the cat sat on the mat", "paris", "query what is gravity document gravity is a force answer"]


def last_hidden(loaded: LoadedModel, seqs: list[list[int]]) -> torch.Tensor:
    """The final hidden state of each sequence's last token, `seqs` run as one flat prefill batch."""
    model, block = loaded.model, 16
    lens = [len(s) for s in seqs]
    tables, first = [], 0
    for n in lens:
        tables.append(list(range(first, first + -(-n // block))))
        first += len(tables[-1])
    meta = AttentionMetadata.build(lens, lens, tables, block)
    caches = allocate_kv_caches(model.num_layers, first, block, model.num_kv_heads, model.head_dim, loaded.dtype)
    ids = torch.tensor([t for s in seqs for t in s])
    positions = torch.cat([torch.arange(n) for n in lens])
    with torch.inference_mode():
        hidden = model(ids, positions, caches, meta)
    return hidden[meta.query_start_loc[1:].long() - 1]


def token_ids(loaded: LoadedModel) -> list[list[int]]:
    return [loaded.load_tokenizer()(t).input_ids for t in TEXTS]


@pytest.mark.parametrize(("family", "labels"), [("qwen3", 1), ("llama", 3), ("qwen2", 2), ("mistral", 1)])
def test_logits_match_transformers(family: str, labels: int, tmp_path: Path) -> None:
    hf = save_tiny_decoder_classifier(tmp_path, family, num_labels=labels)
    loaded = load_model(str(tmp_path), dtype="float32")
    model = loaded.model
    assert loaded.architecture == hf.config.architectures[0]
    assert loaded.is_pooling_model and model.is_causal
    assert model.num_labels == labels and model.default_pooling_type == "last"
    assert model.id2label == {i: f"LABEL_{i}" for i in range(labels)}
    seqs = token_ids(loaded)
    logits = model.classify(last_hidden(loaded, seqs))
    assert logits.dtype == torch.float32 and logits.shape == (3, labels)
    for seq, ours in zip(seqs, logits, strict=True):
        with torch.inference_mode():  # one unpadded sequence: transformers pools its last token
            expected = hf(torch.tensor([seq])).logits[0]
        assert (ours - expected).abs().max() < 1e-4


def test_bfloat16(tmp_path: Path) -> None:
    hf = save_tiny_decoder_classifier(tmp_path, "qwen3", num_labels=2)
    loaded = load_model(str(tmp_path), dtype="bfloat16")
    assert loaded.model.score.weight.dtype == torch.bfloat16
    seqs = token_ids(loaded)
    logits = loaded.model.classify(last_hidden(loaded, seqs))
    assert logits.dtype == torch.float32
    with torch.inference_mode():
        expected = torch.cat([hf(torch.tensor([s])).logits for s in seqs])
    assert (logits - expected).abs().max() < 0.1


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def reranker(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("reranker")
    return path, save_tiny_qwen3_reranker(path, tie_word_embeddings=request.param)


def causal_logits(hf: Any, seqs: list[list[int]], tokens: list[int]) -> torch.Tensor:
    """The causal LM's last-token logits of `tokens`, per sequence."""
    with torch.inference_mode():
        return torch.stack([hf(torch.tensor([s])).logits[0, -1, tokens] for s in seqs])


def test_qwen3_reranker_conversion(reranker: tuple[Path, Any]) -> None:
    """sigmoid(score) is the causal LM's softmax probability of "yes" over ["no", "yes"]."""
    path, hf = reranker
    loaded = load_model(str(path), dtype="float32", hf_overrides=RERANKER_OVERRIDES)
    model = loaded.model
    assert loaded.architecture == "Qwen3ForSequenceClassification" and loaded.is_pooling_model
    assert model.num_labels == 1
    seqs = token_ids(loaded)
    scores = torch.sigmoid(model.classify(last_hidden(loaded, seqs))[:, 0])
    no_yes = loaded.load_tokenizer().convert_tokens_to_ids(["no", "yes"])
    expected = causal_logits(hf, seqs, no_yes).softmax(-1)[:, 1]
    assert (scores - expected).abs().max() < 1e-5
    assert scores.std() > 0.01  # the sequences score apart


def test_classifier_from_tokens_takes_their_lm_head_rows(reranker: tuple[Path, Any]) -> None:
    path, hf = reranker
    tokens = ["cat", "dog", "yes"]
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": tokens}
    loaded = load_model(str(path), dtype="float32", hf_overrides=overrides)
    assert loaded.model.num_labels == 3
    seqs = token_ids(loaded)
    logits = loaded.model.classify(last_hidden(loaded, seqs))
    expected = causal_logits(hf, seqs, loaded.load_tokenizer().convert_tokens_to_ids(tokens))
    assert (logits - expected).abs().max() < 1e-4


def test_convert_classify(reranker: tuple[Path, Any]) -> None:
    """``convert="classify"`` makes the causal LM its sequence classifier: the head from the
    overrides' tokens, or from a ``score.weight`` the checkpoint must then have."""
    path, hf = reranker
    overrides = {"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}
    loaded = load_model(str(path), dtype="float32", convert="classify", hf_overrides=overrides)
    assert loaded.architecture == "Qwen3ForSequenceClassification" and loaded.model.num_labels == 1
    seqs = token_ids(loaded)
    scores = torch.sigmoid(loaded.model.classify(last_hidden(loaded, seqs))[:, 0])
    expected = causal_logits(hf, seqs, loaded.load_tokenizer().convert_tokens_to_ids(["no", "yes"]))
    assert (scores - expected.softmax(-1)[:, 1]).abs().max() < 1e-5
    with pytest.raises(ModelLoadError, match="checkpoint lacks weights for score.weight"):
        load_model(str(path), dtype="float32", convert="classify")


def test_overrides_are_cached_apart(reranker: tuple[Path, Any]) -> None:
    """A warm load reads the overridden config back from the cache, and the plain one stays plain."""
    path, _ = reranker
    first = load_model(str(path), dtype="float32", hf_overrides=RERANKER_OVERRIDES)
    again = load_model(str(path), dtype="float32", hf_overrides=RERANKER_OVERRIDES)
    assert isinstance(again.config, config_cache.CachedConfig)
    assert again.config.classifier_from_token == ["no", "yes"]
    assert torch.equal(again.model.score.weight, first.model.score.weight)
    plain = load_model(str(path), dtype="float32")
    assert plain.architecture == "Qwen3ForCausalLM" and not plain.is_pooling_model


def test_convert_embed_drops_the_lm_head(reranker: tuple[Path, Any]) -> None:
    path, hf = reranker
    loaded = load_model(str(path), dtype="float32", convert="embed")
    assert loaded.architecture == "Qwen3ForCausalLM" and loaded.is_pooling_model
    assert not any(name.startswith("lm_head") for name, _ in loaded.model.named_parameters())
    seqs = token_ids(loaded)
    ours = last_hidden(loaded, seqs)
    with torch.inference_mode():
        expected = torch.stack([hf.model(torch.tensor([s])).last_hidden_state[0, -1] for s in seqs])
    assert (ours - expected).abs().max() < 1e-4


def test_refusals(reranker: tuple[Path, Any]) -> None:
    path, _ = reranker
    with pytest.raises(ModelLoadError, match="hf_overrides cannot change model_type"):
        load_model(str(path), hf_overrides={"model_type": "llama"})
    with pytest.raises(ModelLoadError, match="unknown convert 'rewards'"):
        load_model(str(path), convert="rewards")
    with pytest.raises(ModelLoadError, match=r"classifier_from_token \['zebra'\] are not tokens"):
        load_model(str(path), hf_overrides={**RERANKER_OVERRIDES, "classifier_from_token": ["no", "zebra"]})
    with pytest.raises(ModelLoadError, match="needs classifier_from_token of two tokens"):
        load_model(str(path), hf_overrides={**RERANKER_OVERRIDES, "classifier_from_token": ["yes"]})


def test_dummy_weights_need_no_tokenizer(reranker: tuple[Path, Any], tmp_path: Path) -> None:
    path, _ = reranker
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    loaded = load_model(str(tmp_path), dtype="float32", load_format="dummy", hf_overrides=RERANKER_OVERRIDES)
    assert loaded.tokenizer_path is None
    assert torch.isfinite(loaded.model.classify(last_hidden(loaded, [[3, 4, 5], [6]]))).all()
