"""Tokenizers loaded ahead of need, while the worker loads the model.

The detokenizer and the client each need the model's tokenizer, and only learn its path from
the worker once the model is loaded: loaded then, one after the other, they add seconds to every
start (most of it importing transformers). `prefetch` starts loading them in a thread as soon as
the engine starts, from the path the worker will report when it can be told in advance
(`sonar.models.loader.cached_tokenizer_dir`); `load` takes a prefetched instance for that path,
or loads one there and then (another path, or nothing prefetched).

Each caller gets its own instance: a fast tokenizer is not meant to be shared between threads.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from sonar.engine.config import EngineConfig
from sonar.log import get_logger
from sonar.models import config_cache

log = get_logger("sonar.tokenizers")

_lock = threading.Lock()
_prefetched: dict[str, list[Future[Any]]] = {}


def _from_pretrained(path: str) -> Any:
    """transformers' tokenizer for `path`; given the model config when the cache of resolved
    configs holds it (`sonar.models.config_cache`), so transformers does not read it again
    (importing its config modules takes seconds)."""
    config = None
    try:
        config = config_cache.read((Path(path) / "config.json").read_bytes())
    except OSError:
        pass
    with config_cache.TRANSFORMERS_LOCK:  # one at a time: two replicas' at once once failed to import
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, **({} if config is None else {"config": config}))


def prefetch(path: str, copies: int = 2) -> None:
    """Start loading `copies` instances of the tokenizer at `path` in a background thread."""
    futures: list[Future[Any]] = [Future() for _ in range(copies)]
    with _lock:
        _prefetched.setdefault(path, []).extend(futures)

    def run() -> None:
        for future in futures:
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(_from_pretrained(path))
            except BaseException as exc:  # `load` loads again and raises it there
                future.set_exception(exc)

    threading.Thread(target=run, name="tokenizer-prefetch", daemon=True).start()


def prefetch_for(config: EngineConfig) -> str | None:
    """Prefetch the tokenizers of the engine `config` starts, when their path is known before the
    model loads; the path, or None."""
    path = config.tokenizer
    if path is None:
        from sonar.models.loader import cached_tokenizer_dir

        found = cached_tokenizer_dir(config.model)
        path = None if found is None else str(found)
    if path is not None:
        from sonar.actors import InProcess

        # the client's, and the detokenizer's when it runs in this process
        prefetch(path, 2 if isinstance(config.placement_of("detokenizer"), InProcess) else 1)
    return path


def load(path: str) -> Any:
    """A tokenizer for `path` of its own: a prefetched one when there is one, else loaded now."""
    with _lock:
        waiting = _prefetched.get(path)
        future = waiting.pop(0) if waiting else None
        if waiting is not None and not waiting:
            del _prefetched[path]
    if future is not None:
        try:
            return future.result()
        except Exception as exc:
            log.warning("tokenizer.prefetch_failed", path=path, error=repr(exc))
    return _from_pretrained(path)
