"""Fixtures shared by the tests of the pure cores."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def embedded_tokenizer():
    """The embedded model's tokenizer (SmolLM2, byte-level BPE), converted once per cache."""
    from sonar.models.embedded import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="session")
def byte_fallback_tokenizer():
    """A tiny SentencePiece-style tokenizer (Unigram, "▁" for spaces, byte fallback).

    Built in memory: characters outside its small vocabulary (emoji, CJK) become `<0xNN>` byte
    tokens, and its decoder strips the leading space of a string, like Llama 2's or Mistral's.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    pieces = ["<unk>", "<s>", "</s>"]
    pieces += [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁", "▁Hello", "▁world", "▁the", "▁end", "!", ".", "ab", "cd"]
    pieces += list("abcdefghijklmnopqrstuvwxyzHW")
    vocab = [(p, 0.0 if p.startswith("<") else -float(len(pieces) - len(p))) for p in pieces]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return tok
