"""Tiny random checkpoints of pooling models, each saved with a working fast tokenizer.

Every helper builds a seeded transformers model (fp32, well under a second), spreads its weights
(biases and norm weights too, so nothing is at its trivial initial value), saves it with
``save_pretrained`` beside a tokenizer that `AutoTokenizer.from_pretrained` loads, and returns
the transformers model as the reference. The tokenizers know the words of `WORDS` (lowercased);
any other word is the unknown token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import torch

WORDS = (
    "the a an of to and in is it you that he she was for on are with as his her they be at one have this "
    "from or had by word but what some we can out other were all there when up use your how said each "
    "which do their time if will way about many then them write would like so these long make thing see "
    "him two has look more day could go come did number sound no yes most people my over know water than "
    "call first who may down side been now find any new work part take get place made live where after "
    "back little only round man year came show every good me give our under name very through just form "
    "capital france paris city river cat dog sat mat query document answer relevant gravity force"
).split()
"""The tokenizers' words, "yes" and "no" among them."""

EncoderKind = Literal["bert", "roberta", "xlm-roberta"]
Head = Literal["sequence", "token"]
HEADS = {"sequence": "ForSequenceClassification", "token": "ForTokenClassification"}


def spread_weights(model: torch.nn.Module, scale: float = 0.15) -> None:
    """Random weights from torch's current seed: norm weights around 1, the rest around 0."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm.weight" in name.lower():
                param.copy_(1 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(scale * torch.randn_like(param))


def save_bert_tokenizer(path: Path, lower_case: bool = True) -> int:
    """A WordPiece tokenizer of whole `WORDS` with BERT's specials (ids 0-4: [PAD] [UNK] [CLS]
    [SEP] [MASK]), lowercasing unless `lower_case` is False (then a capitalized word is [UNK]); a
    pair gets token type ids 0 then 1. Returns the vocabulary size."""
    from transformers import BertTokenizer

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS])}
    BertTokenizer(vocab=vocab, do_lower_case=lower_case).save_pretrained(str(path))
    return len(vocab)


def save_roberta_tokenizer(path: Path) -> int:
    """A word-level tokenizer of `WORDS` with RoBERTa's specials (``<s>`` 0, ``<pad>`` 1, ``</s>``
    2, ``<unk>`` 3) and its templates (``<s> A </s>``, ``<s> A </s></s> B </s>``), no token type
    ids. Returns the vocabulary size."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<s>", "<pad>", "</s>", "<unk>", *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        cls_token="<s>",
        sep_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_input_names=["input_ids", "attention_mask"],
    ).save_pretrained(str(path))
    return len(vocab)


def save_word_tokenizer(path: Path) -> int:
    """A plain word-level tokenizer of `WORDS` for the decoders (``<pad>`` 0, ``<unk>`` 1, no
    template). Returns the vocabulary size."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>").save_pretrained(str(path))
    return len(vocab)


def save_tiny_bert(
    path: Path,
    kind: EncoderKind = "bert",
    num_labels: int | None = None,
    seed: int = 0,
    head: Head = "sequence",
    lower_case: bool = True,
    **config: Any,
) -> Any:
    """A tiny ``BertModel`` / ``RobertaModel`` / ``XLMRobertaModel`` (hidden 64, 2 layers, 4
    heads, 128 positions; `config` sets other fields), or with `num_labels` its
    ``*ForSequenceClassification`` (``*ForTokenClassification`` with `head` ``token``); saved
    with its tokenizer under `path` (a BERT tokenizer that keeps case unless `lower_case`).
    Returns the transformers model (eval mode)."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    common = (
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=128,
        )
        | config
    )
    if kind == "bert":
        hf_config = transformers.BertConfig(vocab_size=save_bert_tokenizer(path, lower_case), **common)
        prefix = "Bert"
    else:
        vocab_size = save_roberta_tokenizer(path)
        # type_vocab_size 1 as the published RoBERTa / XLM-R checkpoints
        extra = dict(vocab_size=vocab_size, pad_token_id=1, bos_token_id=0, eos_token_id=2, type_vocab_size=1)
        common["max_position_embeddings"] += 2  # positions start at pad_token_id + 1
        prefix = "Roberta" if kind == "roberta" else "XLMRoberta"
        hf_config = getattr(transformers, f"{prefix}Config")(**extra, **common)
    suffix = "Model" if num_labels is None else HEADS[head]
    if num_labels is not None:
        hf_config.num_labels = num_labels
    hf_config.architectures = [f"{prefix}{suffix}"]
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}{suffix}")(hf_config).eval()
    spread_weights(model)
    model.save_pretrained(str(path))
    return model


def write_sentence_transformers(
    path: Path, pooling: str, normalize: bool, max_seq_length: int = 128, do_lower_case: bool = False
) -> None:
    """Make the checkpoint folder `path` a sentence-transformers model: Transformer (lowercasing
    its input with `do_lower_case`), Pooling (``cls``, ``mean`` or ``last``) and, with
    `normalize`, Normalize."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (path / "2_Normalize").mkdir(exist_ok=True)
    (path / "modules.json").write_text(json.dumps(modules, indent=2))
    (path / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": max_seq_length, "do_lower_case": do_lower_case})
    )
    (path / "1_Pooling").mkdir(exist_ok=True)
    dim = json.loads((path / "config.json").read_text())["hidden_size"]
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps(
            {
                "word_embedding_dimension": dim,
                "pooling_mode_cls_token": pooling == "cls",
                "pooling_mode_mean_tokens": pooling == "mean",
                "pooling_mode_max_tokens": False,
                "pooling_mode_mean_sqrt_len_tokens": False,
                "pooling_mode_weightedmean_tokens": False,
                "pooling_mode_lasttoken": pooling == "last",
                "include_prompt": True,
            },
            indent=2,
        )
    )


def save_tiny_sentence_transformer(
    path: Path, pooling: Literal["mean", "cls"] = "mean", normalize: bool = True, seed: int = 0
) -> Any:
    """A tiny BERT saved as a sentence-transformers folder that ``SentenceTransformer(str(path))``
    loads. Returns the transformers ``BertModel``."""
    model = save_tiny_bert(path, "bert", seed=seed)
    write_sentence_transformers(path, pooling, normalize)
    return model


Family = Literal["qwen3", "qwen2", "llama", "mistral"]


def tiny_decoder_config(family: Family, vocab_size: int, **extra: Any) -> Any:
    """A tiny config of `family` (hidden 64, 2 layers, 4 heads over 2 KV heads)."""
    import transformers

    cls = {"qwen3": "Qwen3Config", "qwen2": "Qwen2Config", "llama": "LlamaConfig", "mistral": "MistralConfig"}
    return getattr(transformers, cls[family])(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
        **extra,
    )


def save_tiny_decoder_classifier(
    path: Path, family: Family = "qwen3", num_labels: int = 1, seed: int = 0, head: Head = "sequence"
) -> Any:
    """A tiny ``<Family>ForSequenceClassification`` (``<Family>ForTokenClassification`` with `head`
    ``token``): a ``score`` head, no ``lm_head``, with a word tokenizer. Returns the transformers
    model (eval mode)."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    config = tiny_decoder_config(family, save_word_tokenizer(path), num_labels=num_labels)
    name = {"qwen3": "Qwen3", "qwen2": "Qwen2", "llama": "Llama", "mistral": "Mistral"}[family]
    config.architectures = [f"{name}{HEADS[head]}"]
    torch.manual_seed(seed)
    model = getattr(transformers, f"{name}{HEADS[head]}")(config).eval()
    spread_weights(model)
    model.save_pretrained(str(path))
    return model


RERANKER_OVERRIDES = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}
"""The ``--hf-overrides`` that serve an original Qwen3-Reranker as a classifier (vLLM's)."""


def save_tiny_qwen3_reranker(path: Path, tie_word_embeddings: bool = True, seed: int = 0) -> Any:
    """A tiny ``Qwen3ForCausalLM`` as Qwen3-Reranker is published (it judges with the logits of
    "yes" and "no", both in its tokenizer); serve it with `RERANKER_OVERRIDES`. Returns the
    transformers model (eval mode)."""
    from transformers import Qwen3ForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    config = tiny_decoder_config("qwen3", save_word_tokenizer(path), tie_word_embeddings=tie_word_embeddings)
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).eval()
    spread_weights(model)
    model.save_pretrained(str(path))
    return model
