"""Scores of text pairs on a pooling model: what /score and /rerank answer, usable from the library.

    results = await score(llm, "what is a cat?", ["a small feline", "a tall tree"])

Which score depends on the model (`LLM.info.pooling`):

- a **cross-encoder** (it serves ``classify`` with one label, e.g. a BertForSequenceClassification
  reranker): each pair is tokenized as the model was trained, as a text pair (``[CLS] q [SEP] d
  [SEP]`` for BERT), in a worker thread; the position where the second text starts
  (`PoolingParams.pair_start`, the first token whose token type is 1) lets a model with token
  type embeddings tell the two apart. The score is the classifier's probability (its sigmoid),
  or its logit with ``use_activation=False``. This is sentence-transformers' `CrossEncoder.predict`.
- an **embedding model** (it serves ``embed``): each distinct text is embedded once; the score of a
  pair is the cosine similarity of its two embeddings.
- anything else: a 400 saying why.

Pairs are one query against each document (1:N) or N queries against N documents, by position.
A pair longer than the model's context is refused (`context_length_exceeded`) unless
`truncate_prompt_tokens` is set: -1 cuts it to the model's length, k > 0 to k tokens (a
cross-encoder's pair is cut as the tokenizer cuts pairs: the longer text first). Every pair runs at
once (the scheduler batches them); the results are in pair order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import anyio

from sonar.engine.gather import gather
from sonar.errors import InvalidRequestError
from sonar.pooling_params import PoolingInfo, PoolingParams

if TYPE_CHECKING:
    from sonar.engine.llm import LLM

__all__ = ["ScoreResult", "pair_up", "score", "scoring_kind"]


@dataclass(frozen=True)
class ScoreResult:
    index: int
    """The pair's position (the document's, for 1:N)."""
    score: float
    prompt_tokens: int
    """The tokens this pair added to the work: with an embedding model, a text already embedded for
    an earlier pair is not counted again, so the sum over the results is the call's usage."""


def pair_up(queries: str | Sequence[str], documents: str | Sequence[str]) -> list[tuple[str, str]]:
    """The (query, document) pairs: one query against each document, or N against N by position."""
    qs = [queries] if isinstance(queries, str) else list(queries)
    ds = [documents] if isinstance(documents, str) else list(documents)
    if not qs:
        raise InvalidRequestError("queries must not be empty", param="queries")
    if not ds:
        raise InvalidRequestError("documents must not be empty", param="documents")
    if len(qs) == 1:
        return [(qs[0], d) for d in ds]
    if len(qs) != len(ds):
        raise InvalidRequestError(
            f"queries and documents must be as many (pairs), or queries one text: got {len(qs)} and {len(ds)}",
            param="documents",
        )
    return list(zip(qs, ds))


def scoring_kind(info: PoolingInfo | None) -> str:
    """ "cross-encoder" or "embedding": how `info`'s model scores a pair (else a 400 saying why)."""
    if info is None:
        raise InvalidRequestError(
            "this model is not a pooling model, so it cannot score: serve it with --runner pooling "
            "(a cross-encoder or an embedding model), or --convert embed",
            param="model",
        )
    if "classify" in info.tasks and info.num_labels == 1:
        return "cross-encoder"
    if "embed" in info.tasks:
        return "embedding"
    raise InvalidRequestError(
        f"this model cannot score text pairs: scores come from a cross-encoder (a classifier with one label; "
        f"this one has {info.num_labels}) or an embedding model (it serves {', '.join(info.tasks) or 'no task'})",
        param="model",
    )


async def score(
    llm: LLM,
    queries: str | Sequence[str],
    documents: str | Sequence[str],
    *,
    truncate_prompt_tokens: int | None = None,
    use_activation: bool | None = None,
    priority: int = 0,
    lora: str | None = None,
    request_id: str | None = None,
) -> list[ScoreResult]:
    """The score of each (query, document) pair (see the module docstring), in pair order.
    `request_id`: the prefix of the engine requests' ids (each gets ``-<i>``)."""
    pairs = pair_up(queries, documents)
    kind = scoring_kind(llm.info.pooling)
    for q, d in pairs:  # every text before any runs
        llm.check_prompt_chars(q, "queries")
        llm.check_prompt_chars(d, "documents")
    ids = (lambda i: None) if request_id is None else (lambda i: f"{request_id}-{i}")
    if kind == "cross-encoder":
        return await _cross_encode(llm, pairs, truncate_prompt_tokens, use_activation, priority, lora, ids)
    if use_activation is not None:
        raise InvalidRequestError(
            "use_activation applies to cross-encoders only: this model scores by cosine similarity",
            param="use_activation",
        )
    return await _cosine(llm, pairs, truncate_prompt_tokens, priority, lora, ids)


async def _cross_encode(
    llm: LLM,
    pairs: list[tuple[str, str]],
    truncate: int | None,
    use_activation: bool | None,
    priority: int,
    lora: str | None,
    ids: Callable[[int], str | None],
) -> list[ScoreResult]:
    tokenizer = llm.tokenizer
    if tokenizer is None:
        raise InvalidRequestError("scoring with a cross-encoder needs the model's tokenizer", param="model")
    limit = llm.info.max_model_len
    if truncate is not None and (isinstance(truncate, bool) or truncate == 0 or truncate < -1 or truncate > limit):
        raise InvalidRequestError(  # as `LLM.encode` refuses it: the pairs are cut here, not there
            f"truncate_prompt_tokens must be -1 (the model's length) or from 1 to the model's maximum context length "
            f"{limit}, got {truncate!r}",
            param="truncate_prompt_tokens",
        )
    max_length = None if truncate is None else (limit if truncate < 0 else truncate)

    def tokenize() -> list[tuple[list[int], int | None]]:
        return [pair_tokens(tokenizer, q, d, max_length) for q, d in pairs]

    encoded = await anyio.to_thread.run_sync(tokenize)

    async def one(i: int) -> ScoreResult:
        prompt, pair_start = encoded[i]
        params = PoolingParams(task="classify", use_activation=use_activation, pair_start=pair_start)
        try:
            out = await llm.encode(prompt, params, priority=priority, request_id=ids(i), lora=lora)
        except InvalidRequestError as exc:
            raise _named(exc, "documents") from None
        values = out.data.tolist()
        return ScoreResult(i, float(values[0]), len(out.prompt_token_ids))

    return await gather([lambda i=i: one(i) for i in range(len(pairs))])


def pair_tokens(tokenizer: Any, query: str, document: str, max_length: int | None) -> tuple[list[int], int | None]:
    """A text pair's token ids as the tokenizer joins a pair, and where the second text starts (the
    first token of type 1; None when the tokenizer gives no token types). `max_length`: cut the
    pair to that many tokens (None: never cut; the engine refuses a pair too long)."""
    cut = {"truncation": True, "max_length": max_length} if max_length is not None else {"truncation": False}
    enc = tokenizer(text=query, text_pair=document, **cut)
    types = enc.get("token_type_ids")
    pair_start = next((i for i, t in enumerate(types) if t == 1), None) if types is not None else None
    return list(enc["input_ids"]), pair_start


async def _cosine(
    llm: LLM,
    pairs: list[tuple[str, str]],
    truncate: int | None,
    priority: int,
    lora: str | None,
    ids: Callable[[int], str | None],
) -> list[ScoreResult]:
    distinct = list(dict.fromkeys(t for pair in pairs for t in pair))
    queries = {q for q, _ in pairs}

    async def embed(i: int) -> tuple[list[float], int]:
        try:
            out = await llm.encode(
                distinct[i],
                PoolingParams(task="embed"),
                truncate_prompt_tokens=truncate,
                priority=priority,
                request_id=ids(i),
                lora=lora,
            )
        except InvalidRequestError as exc:
            raise _named(exc, "queries" if distinct[i] in queries else "documents") from None
        return out.data.tolist(), len(out.prompt_token_ids)

    embedded = dict(zip(distinct, await gather([lambda i=i: embed(i) for i in range(len(distinct))])))
    counted: set[str] = set()
    results = []
    for i, (q, d) in enumerate(pairs):
        tokens = sum(embedded[t][1] for t in dict.fromkeys((q, d)) if t not in counted)
        counted.update((q, d))
        results.append(ScoreResult(i, cosine(embedded[q][0], embedded[d][0]), tokens))
    return results


def _named(exc: InvalidRequestError, param: str) -> InvalidRequestError:
    """The engine's refusal of a text (its param ``input``) naming the argument it came from."""
    if exc.param == "input":
        exc.param = param
    return exc


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """The cosine similarity of two vectors (0 where one is zero), kept inside [-1, 1] where
    rounding would step out (a text against itself)."""
    dot = math.fsum(x * y for x, y in zip(a, b))
    norm = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return max(-1.0, min(1.0, dot / norm)) if norm else 0.0
