"""Compiling structured output specs off the event loop, cached, bounded in size and time.

`GrammarCompiler.compile(params)` turns a request's `StructuredOutputsParams` into a
`CompiledGrammar` or raises `InvalidRequestError` (param ``structured_outputs``) with the
backend's message. The cache is keyed by (backend, canonical spec) within one compiler, and there
is one compiler per tokenizer and vocabulary in a process (`compiler_for`), so the `LLM` handle
(which validates a request) and the scheduler (which builds its matcher) share compiles when they
run in one process. A cache entry is the compile's future: requests for a spec being compiled wait
for that compile rather than start another, and a spec that failed fails again at once.

Bounds: a spec longer than ``max_chars`` is refused before compiling; at most two compiles run at
once, each in a thread of its own, and a caller waits at most ``timeout`` seconds (queueing
included). A compile that overruns cannot be interrupted (neither library can be): it finishes in
its thread and is then cached, and the request that waited for it is refused with a message
naming the limit. (The threads are not daemons: the native compilers abort the process if it
exits under them, so an exit waits for the compiles in flight, which the size limit bounds.)
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import anyio
import torch

from sonar.errors import InvalidRequestError
from sonar.sampling_params import StructuredOutputsParams
from sonar.structured.backends import Backends, CompiledGrammar, GrammarError, GrammarSpec, compile_spec
from sonar.structured.bitmask import pack_allowed
from sonar.structured.config import BACKENDS as CONFIG_BACKENDS
from sonar.structured.config import StructuredOutputsConfig

PARAM = "structured_outputs"

COMPILE_THREADS = 2
"""Compiles that run at once (the others wait their turn, within their timeout)."""

CACHE_ENTRIES = 1024
"""Compiled grammars kept per tokenizer (least recently used go first)."""


class GrammarCompiler:
    """Compiles and caches the grammars of one tokenizer."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self.backends = Backends(tokenizer, vocab_size, list(eos_token_ids))
        self._running = threading.BoundedSemaphore(COMPILE_THREADS)
        self._cache: OrderedDict[tuple[str, GrammarSpec], Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0
        """Compiles started (cache misses), for tests and stats."""
        self._token_bytes: list[bytes] | None = None
        self._opening: dict[tuple[str, ...], tuple[frozenset[int], torch.Tensor]] = {}

    def token_bytes(self) -> list[bytes]:
        """The text of every token id as UTF-8 bytes (special tokens as their text; a byte-level
        piece as its bytes), from xgrammar's reading of the vocabulary. Call it off the event
        loop the first time."""
        with self._lock:
            if self._token_bytes is None:
                vocab = self.backends.get("xgrammar").info.decoded_vocab
                self._token_bytes = [bytes(piece) for piece in vocab]
            return self._token_bytes

    def opening_tokens(self, starts: tuple[str, ...]) -> tuple[frozenset[int], torch.Tensor]:
        """The tokens that are a whole start marker of `starts` (leading whitespace aside), and
        their packed bitmask row (`sonar.core.thinking.ThinkingGate`'s ``opening_ids`` and
        ``opening_row``); one pass over the vocabulary per set of markers, then cached."""
        token_bytes = self.token_bytes()
        with self._lock:
            found = self._opening.get(starts)
            if found is None:
                marks = tuple(s.encode() for s in starts)
                ids = frozenset(t for t, b in enumerate(token_bytes) if b.lstrip(b" \t\r\n").startswith(marks))
                allowed = torch.zeros(1, self.vocab_size, dtype=torch.bool)
                allowed[0, [t for t in ids if t < self.vocab_size]] = True
                found = self._opening[starts] = (ids, pack_allowed(allowed)[0])
            return found

    def _future(
        self, params: StructuredOutputsParams, config: StructuredOutputsConfig, max_chars: int
    ) -> Future[CompiledGrammar]:
        backend = params.backend or config.backend
        if backend not in CONFIG_BACKENDS:
            raise InvalidRequestError(
                f"structured_outputs.backend {backend!r} is not one of {', '.join(CONFIG_BACKENDS)}", param=PARAM
            )
        try:
            spec = GrammarSpec.of(
                params,
                disable_any_whitespace=config.disable_any_whitespace,
                disable_additional_properties=config.disable_additional_properties,
            )
        except GrammarError as exc:
            raise InvalidRequestError(f"structured_outputs: {exc}", param=PARAM) from None
        if spec.size > max_chars:
            raise InvalidRequestError(
                f"structured_outputs: the {spec.kind} spec has {spec.size} characters, more than the limit of "
                f"{max_chars} (max_structured_output_chars, --max-structured-output-chars)",
                param=PARAM,
            )
        key = (backend, spec)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._submit(compile_spec, self.backends, backend, spec)
            self.compiles += 1
            self._cache[key] = future
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
            return future

    def _submit(self, fn: Callable[..., CompiledGrammar], *args: Any) -> Future[CompiledGrammar]:
        future: Future[CompiledGrammar] = Future()

        def run() -> None:
            with self._running:
                future.set_running_or_notify_cancel()
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:
                    future.set_exception(exc)

        threading.Thread(target=run, name="sonar-grammar").start()
        return future

    async def compile(
        self,
        params: StructuredOutputsParams,
        config: StructuredOutputsConfig,
        *,
        max_chars: int,
        timeout: float,
    ) -> CompiledGrammar:
        """The compiled grammar of `params` (from the cache, or compiled in a thread)."""
        future = self._future(params, config, max_chars)
        if not future.done():
            with anyio.move_on_after(timeout):
                try:
                    await asyncio.shield(asyncio.wrap_future(future))
                except Exception:
                    pass  # raised by `_result`, as its message says
        return _result(future, timeout, 0)

    def compile_sync(
        self,
        params: StructuredOutputsParams,
        config: StructuredOutputsConfig,
        *,
        max_chars: int,
        timeout: float,
    ) -> CompiledGrammar:
        """`compile` for a caller without an event loop (it blocks)."""
        return _result(self._future(params, config, max_chars), timeout, timeout)


def _result(future: Future[CompiledGrammar], timeout: float, wait: float) -> CompiledGrammar:
    try:
        return future.result(timeout=wait)
    except FutureTimeout:
        raise InvalidRequestError(
            f"structured_outputs: the grammar did not compile within {timeout:g} s "
            "(structured_outputs_compile_timeout, --structured-outputs-compile-timeout)",
            param=PARAM,
        ) from None
    except GrammarError as exc:
        raise InvalidRequestError(f"structured_outputs: {exc}", param=PARAM) from None


_COMPILERS: dict[tuple[str, int, tuple[int, ...]], GrammarCompiler] = {}
_COMPILERS_LOCK = threading.Lock()


def compiler_for(
    tokenizer_path: str, vocab_size: int, eos_token_ids: list[int], tokenizer: Any = None
) -> GrammarCompiler:
    """The process's compiler for a tokenizer (loaded from `tokenizer_path` unless given: call
    this off the event loop the first time)."""
    key = (tokenizer_path, vocab_size, tuple(eos_token_ids))
    with _COMPILERS_LOCK:
        compiler = _COMPILERS.get(key)
        if compiler is None:
            if tokenizer is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
            compiler = _COMPILERS[key] = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        return compiler
