"""BERT, RoBERTa and XLM-R encoders and cross-encoders against transformers on tiny random checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sonar.kernels.attention import AttentionMetadata
from sonar.models.bert import BertModel
from sonar.models.errors import ModelLoadError
from sonar.models.loader import LoadedModel, load_model
from sonar.models.parallel import PipelineStage, TensorParallel
from tests.models.tiny_pooling import save_tiny_bert, save_tiny_sentence_transformer

TEXTS = ["the cat sat on the mat", "paris", "what is the capital of france and where is the river"]
KINDS = ("bert", "roberta", "xlm-roberta")


def run(loaded: LoadedModel, seqs: list[list[int]], token_types: list[list[int]] | None = None) -> list[torch.Tensor]:
    """The model's last hidden states of `seqs` run as one flat batch, split per sequence."""
    lens = [len(s) for s in seqs]
    meta = AttentionMetadata.build(lens, lens, [[0] * -(-n // 16) for n in lens], 16)
    ids = torch.tensor([t for s in seqs for t in s])
    positions = torch.cat([torch.arange(n) for n in lens])
    types = None if token_types is None else torch.tensor([t for s in token_types for t in s])
    with torch.inference_mode():
        out = loaded.model(ids, positions, [], meta, token_type_ids=types)
    assert out.shape == (sum(lens), loaded.config.hidden_size)
    return list(out.split(lens))


@pytest.fixture(scope="module")
def encoders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    out = {}
    for i, kind in enumerate(KINDS):
        path = tmp_path_factory.mktemp(kind)
        out[kind] = path, save_tiny_bert(path, kind, seed=i)
        path = tmp_path_factory.mktemp(f"{kind}-cls")
        out[f"{kind}-cls"] = path, save_tiny_bert(path, kind, num_labels=3, seed=10 + i)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_hidden_states_match_transformers(kind: str, encoders: dict[str, tuple[Path, Any]]) -> None:
    path, hf = encoders[kind]
    loaded = load_model(str(path), dtype="float32")
    assert loaded.architecture == hf.config.architectures[0]
    assert loaded.is_pooling_model and not loaded.model.is_causal
    assert loaded.model.num_labels == 0 and loaded.model.id2label == {}
    assert loaded.model.default_pooling_type == "cls"
    assert loaded.max_model_len == 128  # RoBERTa's 130 positions less pad_token_id + 1
    tokenizer = loaded.load_tokenizer()
    seqs = [tokenizer(t).input_ids for t in TEXTS]
    assert len({len(s) for s in seqs}) == 3
    for seq, ours in zip(seqs, run(loaded, seqs), strict=True):
        with torch.inference_mode():
            expected = hf(input_ids=torch.tensor([seq])).last_hidden_state[0]
        assert (ours - expected).abs().max() < 1e-4


def test_bert_token_types_of_a_pair(encoders: dict[str, tuple[Path, Any]]) -> None:
    path, hf = encoders["bert"]
    loaded = load_model(str(path), dtype="float32")
    pairs = [loaded.load_tokenizer()(q, d) for q, d in [("capital of france", "paris is a city"), ("cat", "dog")]]
    assert 1 in pairs[0].token_type_ids
    outs = run(loaded, [p.input_ids for p in pairs], [p.token_type_ids for p in pairs])
    for pair, ours in zip(pairs, outs, strict=True):
        with torch.inference_mode():
            expected = hf(
                input_ids=torch.tensor([pair.input_ids]), token_type_ids=torch.tensor([pair.token_type_ids])
            ).last_hidden_state[0]
        assert (ours - expected).abs().max() < 1e-4


@pytest.mark.parametrize("kind", KINDS)
def test_classifier_logits_match_transformers(kind: str, encoders: dict[str, tuple[Path, Any]]) -> None:
    path, hf = encoders[f"{kind}-cls"]
    loaded = load_model(str(path), dtype="float32")
    model = loaded.model
    assert model.num_labels == 3 and model.id2label == {0: "LABEL_0", 1: "LABEL_1", 2: "LABEL_2"}
    tokenizer = loaded.load_tokenizer()
    pairs = [tokenizer(q, d) for q, d in [("what is gravity", "gravity is a force"), ("cat", "the cat sat")]]
    types = [p.token_type_ids for p in pairs] if kind == "bert" else None
    hidden = run(loaded, [p.input_ids for p in pairs], types)
    logits = model.classify(torch.stack([h[0] for h in hidden]))
    assert logits.dtype == torch.float32 and logits.shape == (2, 3)
    for pair, ours in zip(pairs, logits, strict=True):
        with torch.inference_mode():
            expected = hf(**{k: torch.tensor([v]) for k, v in pair.items()}).logits[0]
        assert (ours - expected).abs().max() < 1e-4


@pytest.mark.parametrize("act", ["gelu_new", "gelu_pytorch_tanh", "relu"])
def test_activations(act: str, tmp_path: Path) -> None:
    hf = save_tiny_bert(tmp_path, "bert", hidden_act=act)
    loaded = load_model(str(tmp_path), dtype="float32")
    seq = loaded.load_tokenizer()(TEXTS[0]).input_ids
    with torch.inference_mode():
        expected = hf(input_ids=torch.tensor([seq])).last_hidden_state[0]
    assert (run(loaded, [seq])[0] - expected).abs().max() < 1e-4


def test_bfloat16(encoders: dict[str, tuple[Path, Any]]) -> None:
    path, hf = encoders["xlm-roberta-cls"]
    loaded = load_model(str(path), dtype="bfloat16")
    seq = loaded.load_tokenizer()("the cat", "sat on the mat").input_ids
    logits = loaded.model.classify(run(loaded, [seq])[0][:1])
    with torch.inference_mode():
        expected = hf(input_ids=torch.tensor([seq])).logits
    assert (logits - expected).abs().max() < 0.1


def test_mean_pooled_matches_sentence_transformers(tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    save_tiny_sentence_transformer(tmp_path, pooling="mean", normalize=True)
    loaded = load_model(str(tmp_path), dtype="float32")
    seqs = [loaded.load_tokenizer()(t).input_ids for t in TEXTS]
    ours = torch.stack([h.mean(0) for h in run(loaded, seqs)])
    ours = torch.nn.functional.normalize(ours, dim=-1)
    expected = SentenceTransformer(str(tmp_path), device="cpu").encode(TEXTS, convert_to_tensor=True)
    assert (ours - expected).abs().max() < 1e-4


def test_checkpoint_without_pooler_and_with_prefixes(tmp_path: Path, encoders: dict[str, tuple[Path, Any]]) -> None:
    """A BertModel checkpoint may lack the pooler, or carry the classifiers' ``bert.`` prefix."""
    from safetensors.torch import load_file, save_file

    path, hf = encoders["bert"]
    (tmp_path / "config.json").write_bytes((path / "config.json").read_bytes())
    tensors = load_file(str(path / "model.safetensors"))
    save_file(
        {f"bert.{k}": v for k, v in tensors.items() if not k.startswith("pooler.")}, tmp_path / "model.safetensors"
    )
    loaded = load_model(str(tmp_path), dtype="float32")
    seq = [2, 7, 8, 9, 3]
    with torch.inference_mode():
        expected = hf(input_ids=torch.tensor([seq])).last_hidden_state[0]
    assert (run(loaded, [seq])[0] - expected).abs().max() < 1e-4


def test_missing_weight_is_refused(tmp_path: Path, encoders: dict[str, tuple[Path, Any]]) -> None:
    from safetensors.torch import load_file, save_file

    path, _ = encoders["roberta-cls"]
    (tmp_path / "config.json").write_bytes((path / "config.json").read_bytes())
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["roberta.encoder.layer.1.attention.self.key.weight"], tensors["classifier.out_proj.bias"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"classifier.out_proj.bias, encoder.layer.1.attention.qkv_proj.weight"):
        load_model(str(tmp_path), dtype="float32")


def test_refusals(encoders: dict[str, tuple[Path, Any]]) -> None:
    config = encoders["bert"][1].config
    with pytest.raises(ModelLoadError, match="encoder models run on one device"):
        BertModel(config, parallel=TensorParallel(rank=0, size=2))
    with pytest.raises(ModelLoadError, match="encoder models run on one device"):
        BertModel(config, stage=PipelineStage(index=0, size=2))
    config = type(config).from_dict({**config.to_dict(), "hidden_act": "swish"})
    with pytest.raises(ModelLoadError, match="hidden_act 'swish' is not supported"):
        BertModel(config)


def test_dummy_weights(encoders: dict[str, tuple[Path, Any]]) -> None:
    loaded = load_model(str(encoders["xlm-roberta-cls"][0]), dtype="float32", load_format="dummy")
    hidden = run(loaded, [[0, 5, 6, 2], [0, 7, 2]])
    logits = loaded.model.classify(torch.stack([h[0] for h in hidden]))
    assert logits.shape == (2, 3) and torch.isfinite(logits).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_heads_of_32_match_transformers(dtype: str, tmp_path: Path) -> None:
    """Two heads of 32 (bge-small's head size): the CPU attention takes the native kernel where
    it is built; mixed lengths in one batch."""
    from sonar.kernels import native
    from sonar.kernels.encoder_attention import use_native

    hf = save_tiny_bert(tmp_path, "bert", seed=5, num_attention_heads=2)
    loaded = load_model(str(tmp_path), dtype=dtype)
    assert loaded.model.head_dim == 32
    probe = torch.empty(1, 2, 32, dtype=loaded.dtype)
    if native.available() and torch.ops.sonar_cpu.has_encoder_attention():
        assert use_native(probe, probe, probe)
    tokenizer = loaded.load_tokenizer()
    seqs = [tokenizer(t).input_ids for t in TEXTS]
    for seq, ours in zip(seqs, run(loaded, seqs), strict=True):
        with torch.inference_mode():
            expected = hf(input_ids=torch.tensor([seq])).last_hidden_state[0]
        assert (ours.float() - expected).abs().max() < (1e-4 if dtype == "float32" else 0.15)
