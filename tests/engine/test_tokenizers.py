"""Tokenizers prefetched while the model loads: each caller gets a real tokenizer of its own, a
path nothing was prefetched for loads there and then, and a failed prefetch fails the same way
a plain load does."""

from __future__ import annotations

from pathlib import Path

import pytest

from sonar.engine import tokenizers
from sonar.engine.config import EngineConfig
from sonar.models import embedded


@pytest.fixture(scope="module")
def tokenizer_dir() -> str:
    return str(embedded.tokenizer_dir())


def test_prefetched_copies_are_real_and_separate(tokenizer_dir: str) -> None:
    tokenizers.prefetch(tokenizer_dir, copies=2)
    first, second = tokenizers.load(tokenizer_dir), tokenizers.load(tokenizer_dir)
    third = tokenizers.load(tokenizer_dir)  # nothing prefetched is left: loaded now
    assert len({id(first), id(second), id(third)}) == 3
    ids = third("Hello world").input_ids
    for tok in (first, second):
        assert tok("Hello world").input_ids == ids
        assert tok.decode(ids) == "Hello world"
    assert tokenizer_dir not in tokenizers._prefetched


def test_a_failed_prefetch_fails_like_a_load(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-tokenizer")
    tokenizers.prefetch(missing, copies=1)
    with pytest.raises(Exception) as prefetched:
        tokenizers.load(missing)
    with pytest.raises(type(prefetched.value)):
        tokenizers.load(missing)


def test_prefetch_for_an_explicit_tokenizer(tokenizer_dir: str) -> None:
    config = EngineConfig.from_args(None, tokenizer=tokenizer_dir)
    assert tokenizers.prefetch_for(config) == tokenizer_dir
    assert tokenizers.load(tokenizer_dir)("Hi").input_ids
    assert tokenizers.load(tokenizer_dir)("Hi").input_ids  # the detokenizer's copy (in this process)
    assert tokenizer_dir not in tokenizers._prefetched
