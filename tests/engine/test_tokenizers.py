"""Tokenizers prefetched while the model loads: each caller gets a real tokenizer of its own, a
path nothing was prefetched for loads there and then, and a failed prefetch fails the same way
a plain load does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sonar.engine import tokenizers
from sonar.engine.config import EngineConfig
from sonar.models import config_cache, embedded


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


def test_a_cached_model_config_is_handed_over(tokenizer_dir: str, tmp_path: Path) -> None:
    """With the model's resolved config cached, the tokenizer is the one transformers builds
    reading the config itself, and no transformers config module is imported for it."""
    import shutil
    import subprocess
    import sys

    from transformers import AutoConfig, AutoTokenizer, LlamaConfig

    model = tmp_path / "model"
    shutil.copytree(tokenizer_dir, model)
    LlamaConfig(architectures=["LlamaForCausalLM"], vocab_size=49152).save_pretrained(str(model))
    config_cache.write((model / "config.json").read_bytes(), AutoConfig.from_pretrained(str(model)))
    ours, theirs = tokenizers.load(str(model)), AutoTokenizer.from_pretrained(str(model))
    chat = [{"role": "user", "content": "Hi there"}]
    for tok in (ours, theirs):
        assert type(tok) is type(theirs) and tok.special_tokens_map == theirs.special_tokens_map
        assert tok("Hello wörld").input_ids == theirs("Hello wörld").input_ids
        assert tok.apply_chat_template(chat, tokenize=False) == theirs.apply_chat_template(chat, tokenize=False)
    code = (
        "import sys\n"
        "from sonar.engine import tokenizers\n"
        f"tokenizers.load({str(model)!r})\n"
        "assert 'transformers.models.llama.configuration_llama' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


RACE = """
import threading
import sonar.engine.tokenizers as tokenizers
from sonar.models.embedded import tokenizer_dir

path, errors, start = str(tokenizer_dir()), [], threading.Barrier(4)

def load():
    start.wait()
    try:
        tokenizers._from_pretrained(path)
    except Exception as exc:
        errors.append(repr(exc))

threads = [threading.Thread(target=load) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(errors)
"""


def test_tokenizers_loading_at_once_in_a_fresh_process_all_load() -> None:
    """Four threads load the first tokenizers of a process at the same moment (two data-parallel
    replicas' prefetches): transformers' lazy import failed one in three such runs unguarded."""
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", RACE], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip().splitlines()[-1] == "[]"
