"""The request and response shapes of the pooling endpoints (`sonar/http/pooling.py`): OpenAI's
/v1/embeddings and vLLM's /pooling, /classify, /score and /rerank (Jina's and Cohere's shape).

As with the generation endpoints (`sonar/http/protocol.py`), nothing is accepted silently: an
unknown field is a 400 naming it, and the vLLM, Jina and Cohere fields Sonar does not do are
declared and refused (with why) unless they ask for what Sonar does anyway (`POOLING_REFUSED`).
What depends on the model (a task it serves, `dimensions` a Matryoshka model allows, a prompt
longer than its context) is checked where the request enters the engine (`LLM.encode`); what
this module checks is the request's own shape: inputs that are strings or token ids, at most
`MAX_INPUTS` of them, the score pairing.

`encoding_format: "base64"` carries each result as the base64 of its float32 little-endian bytes,
which is what the openai SDK decodes (numpy's `frombuffer(..., dtype="float32")`); a per-token
result is its rows one after the other.
"""

from __future__ import annotations

import base64
import sys
import time
from typing import Annotated, Any, ClassVar, Literal, Mapping, Sequence

import msgspec

from sonar.http.protocol import INT64_MAX, Int64, Positive, Refusal, RequestError
from sonar.pooling_params import PooledData, PoolingInfo, PoolingParams, PoolingParamsError

#: OpenAI's cap on the inputs of one embeddings request; Sonar's on every pooling request (and on
#: the documents of a score or rerank request). More is a 400 naming the field.
MAX_INPUTS = 2048

#: -1: cut a prompt to the model's length; k > 0: to k tokens (text by its tokenizer, which keeps its
#: special tokens; token ids keep their last k); 0 is refused.
TruncateTokens = Annotated[int, msgspec.Meta(ge=-1, le=INT64_MAX)]
EncodingFormat = Literal["float", "base64"]

#: The fields every pooling endpoint declares and refuses -> why.
POOLING_REFUSED: dict[str, Refusal] = {
    "request_id": Refusal("Sonar names each request itself (see --enable-request-id-headers)"),
    "add_special_tokens": Refusal("the tokenizer always adds its special tokens to a text input", (True,)),
    "truncation_side": Refusal("truncate_prompt_tokens keeps a prompt's first tokens", ("right",)),
    "padding": Refusal("prompts are never padded", ("do_not_pad",)),
    "cache_salt": Refusal("pooling requests do not salt the prefix cache"),
    "mm_processor_kwargs": Refusal("pooling models take text only"),
    "messages": Refusal("chat-style pooling inputs are not implemented; send input"),
    "chat_template": Refusal("chat-style pooling inputs are not implemented; send input"),
    "chat_template_kwargs": Refusal("chat-style pooling inputs are not implemented; send input"),
    "add_generation_prompt": Refusal("chat-style pooling inputs are not implemented; send input"),
    "continue_final_message": Refusal("chat-style pooling inputs are not implemented; send input"),
}

#: The fields the endpoints with `encoding_format` declare and refuse -> why.
ENCODING_REFUSED: dict[str, Refusal] = {
    **POOLING_REFUSED,
    "embed_dtype": Refusal("base64 results are float32", ("float32",)),
    "endianness": Refusal(
        "base64 results are little-endian", ("little",) + (("native",) if sys.byteorder == "little" else ())
    ),
}

#: The fields /score and /rerank declare and refuse -> why.
SCORE_REFUSED: dict[str, Refusal] = {
    **POOLING_REFUSED,
    "softmax": Refusal("use use_activation"),
    "activation": Refusal("use use_activation"),
    "max_chunks_per_doc": Refusal(
        "documents are never split; a document too long is a 400 (see truncate_prompt_tokens)"
    ),
    "rank_fields": Refusal("documents are strings or objects with text"),
}


class _PoolingRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What every pooling request may carry."""

    refused: ClassVar[Mapping[str, Refusal]] = POOLING_REFUSED

    model: str | None = None
    #: Written in the request log line (--enable-log-requests); refused without it.
    user: str | None = None
    truncate_prompt_tokens: TruncateTokens | None = None
    priority: Int64 = 0
    # Declared to be refused (see `POOLING_REFUSED`): any type, so that the refusal names the field.
    request_id: Any = None
    add_special_tokens: Any = None
    truncation_side: Any = None
    padding: Any = None
    cache_salt: Any = None
    mm_processor_kwargs: Any = None
    messages: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    add_generation_prompt: Any = None
    continue_final_message: Any = None

    def check_truncate(self) -> None:
        if self.truncate_prompt_tokens == 0:
            raise RequestError(
                "truncate_prompt_tokens must be -1 (the model's length) or a positive number of tokens, got 0",
                "truncate_prompt_tokens",
            )


class _InputRequest(_PoolingRequest, kw_only=True):
    """A request of `input`s: a string, a list of strings, a list of token ids or a list of lists
    of token ids (msgspec takes one array type per union, so the list is checked by `inputs()`)."""

    input: str | list[Any]

    def inputs(self) -> list[str | list[int]]:
        self.check_truncate()
        return parse_inputs(self.input, "input")


class _EncodingRequest(_InputRequest, kw_only=True):
    refused: ClassVar[Mapping[str, Refusal]] = ENCODING_REFUSED

    encoding_format: EncodingFormat = "float"
    embed_dtype: Any = None
    endianness: Any = None


class EmbeddingRequest(_EncodingRequest, kw_only=True):
    """POST /v1/embeddings (OpenAI's, with vLLM's extras)."""

    dimensions: Positive | None = None
    #: L2-normalize the embedding (None: the model's default, --pooler-config).
    normalize: bool | None = None
    #: vLLM's newer name for `normalize` on embeddings.
    use_activation: bool | None = None

    def pooling_params(self) -> PoolingParams:
        normalize = self.normalize
        if self.use_activation is not None:
            if normalize is not None and normalize != self.use_activation:
                raise RequestError("normalize and use_activation (its other name) disagree", "use_activation")
            normalize = self.use_activation
        return PoolingParams(task="embed", dimensions=self.dimensions, normalize=normalize)


class PoolingRequest(_EncodingRequest, kw_only=True):
    """POST /pooling (vLLM's): any task the model serves."""

    #: embed, classify, token_embed or token_classify (None: the model's first task).
    task: str | None = None
    dimensions: Positive | None = None
    normalize: bool | None = None
    use_activation: bool | None = None

    def pooling_params(self, info: PoolingInfo) -> PoolingParams:
        task = self.task if self.task is not None else (info.tasks[0] if info.tasks else "embed")
        return PoolingParams(
            task=task, dimensions=self.dimensions, normalize=self.normalize, use_activation=self.use_activation
        )


class ClassificationRequest(_InputRequest, kw_only=True):
    """POST /classify (vLLM's)."""

    #: Probabilities (softmax over the labels; a sigmoid for one label) rather than the logits.
    use_activation: bool | None = None

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(task="classify", use_activation=self.use_activation)


class _ScoringRequest(_PoolingRequest, kw_only=True):
    refused: ClassVar[Mapping[str, Refusal]] = SCORE_REFUSED

    #: A cross-encoder's: probabilities (the default) or raw logits; refused for an embedding model.
    use_activation: bool | None = None
    softmax: Any = None
    activation: Any = None
    max_chunks_per_doc: Any = None
    rank_fields: Any = None


class ScoreRequest(_ScoringRequest, kw_only=True):
    """POST /score (vLLM's): `text_1` against `text_2` (or vLLM's newer `queries` and
    `documents`): one against one, one against each of N, or N pairs."""

    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None

    def pairs(self) -> tuple[list[str], list[str]]:
        """The queries and documents, each as a list: one query and N documents (1:N), or N of
        each (paired by position); which names the request used is for the error messages."""
        self.check_truncate()
        old = self.text_1 is not None or self.text_2 is not None
        new = self.queries is not None or self.documents is not None
        if old and new:
            raise RequestError("give text_1 and text_2, or queries and documents, not both", "queries")
        first, second = ("queries", "documents") if new else ("text_1", "text_2")
        raw_1, raw_2 = (self.queries, self.documents) if new else (self.text_1, self.text_2)
        if raw_1 is None:
            raise RequestError(f"{first} is required", first)
        if raw_2 is None:
            raise RequestError(f"{second} is required", second)
        queries, documents = texts(raw_1, first), texts(raw_2, second)
        if len(queries) > 1 and len(queries) != len(documents):
            raise RequestError(
                f"{first} and {second} must be as many (pairs), or {first} one text: got {len(queries)} and "
                f"{len(documents)}",
                second,
            )
        return queries, documents


class RerankDocument(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A document given as an object (Jina's and Cohere's shape)."""

    text: str


class RerankRequest(_ScoringRequest, kw_only=True):
    """POST /rerank, /v1/rerank, /v2/rerank: the documents by their relevance to `query`."""

    query: str
    documents: list[str | RerankDocument]
    #: The best this many (0 or null: all).
    top_n: Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)] | None = None
    #: Each result carries its document's text (Jina's default; vLLM always does).
    return_documents: bool = True

    def texts(self) -> list[str]:
        self.check_truncate()
        if not self.query:
            raise RequestError("query must not be empty", "query")
        docs = [d if isinstance(d, str) else d.text for d in self.documents]
        return texts(docs, "documents")


def parse_inputs(value: str | list[Any], param: str) -> list[str | list[int]]:
    """`value` as a list of inputs, each a non-empty string or list of token ids; at most
    `MAX_INPUTS` of them."""
    if isinstance(value, str):
        inputs: list[str | list[int]] = [value]
    elif not value:
        raise RequestError(f"{param} must not be empty", param)
    elif all(isinstance(x, str) for x in value):
        inputs = list(value)
    elif all(_is_int(x) for x in value):
        inputs = [list(value)]
    elif all(isinstance(x, list) and all(_is_int(t) for t in x) for x in value):
        inputs = [list(x) for x in value]
    else:
        raise RequestError(
            f"{param} must be a string, a list of strings, a list of token ids or a list of lists of token ids",
            param,
        )
    _check_count(len(inputs), param)
    for x in inputs:
        if not x:
            raise RequestError(f"{param} must not contain an empty {'string' if isinstance(x, str) else 'list'}", param)
        if not isinstance(x, str) and any(t < 0 for t in x):
            raise RequestError(f"{param}: token ids are not negative", param)
    return inputs


def texts(value: str | Sequence[str], param: str) -> list[str]:
    """A text or a list of texts as a non-empty list of non-empty strings, at most `MAX_INPUTS`."""
    items = [value] if isinstance(value, str) else list(value)
    if not items:
        raise RequestError(f"{param} must not be empty", param)
    _check_count(len(items), param)
    if any(not t for t in items):
        raise RequestError(f"{param} must not contain an empty string", param)
    return items


def _check_count(count: int, param: str) -> None:
    if count > MAX_INPUTS:
        raise RequestError(f"{param}: at most {MAX_INPUTS} inputs per request, got {count}", param)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_pooling_params(params: PoolingParams, info: PoolingInfo) -> None:
    """`params.check(info)` as a `RequestError` naming the field (before any input starts)."""
    try:
        params.check(info)
    except PoolingParamsError as exc:
        raise RequestError(str(exc), exc.param) from None


def encode_data(data: PooledData, encoding_format: str) -> list[Any] | str:
    """A result as the response carries it: floats (a vector, or rows), or base64 of its float32
    little-endian bytes."""
    if encoding_format == "base64":
        return base64.b64encode(data.data).decode("ascii")
    return data.tolist()


# -- responses ------------------------------------------------------------------------------------
def _created() -> int:
    return int(time.time())


class PoolingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


def usage(prompt_tokens: int) -> PoolingUsage:
    return PoolingUsage(prompt_tokens, prompt_tokens)


class EmbeddingData(msgspec.Struct, kw_only=True):
    object: str = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "list"
    created: int = msgspec.field(default_factory=_created)
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class PoolingData(msgspec.Struct, kw_only=True):
    index: int
    object: str = "pooling"
    #: A vector, one per prompt token (the token tasks), or base64.
    data: list[Any] | str


class PoolingResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "list"
    created: int = msgspec.field(default_factory=_created)
    model: str
    data: list[PoolingData]
    usage: PoolingUsage


class ClassificationData(msgspec.Struct, kw_only=True):
    index: int
    #: The most probable label's name (`id2label`), else its index as text.
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "list"
    created: int = msgspec.field(default_factory=_created)
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage


def classification(index: int, probs: list[float], labels: Sequence[str]) -> ClassificationData:
    best = max(range(len(probs)), key=probs.__getitem__) if probs else None
    label = None if best is None else (labels[best] if best < len(labels) else str(best))
    return ClassificationData(index=index, label=label, probs=probs, num_classes=len(probs))


class ScoreData(msgspec.Struct, kw_only=True):
    index: int
    object: str = "score"
    score: float


class ScoreResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "list"
    created: int = msgspec.field(default_factory=_created)
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankResultDocument(msgspec.Struct):
    text: str


class RerankResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    index: int
    #: Only with return_documents (the default).
    document: RerankResultDocument | None = None
    relevance_score: float


class RerankResponse(msgspec.Struct, kw_only=True):
    id: str
    model: str
    usage: PoolingUsage
    results: list[RerankResult]


def rerank_results(
    scores: Sequence[float], documents: Sequence[str], top_n: int | None, return_documents: bool
) -> list[RerankResult]:
    """The documents by score, best first (ties in their given order); the best `top_n` (0 or
    None: all)."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if top_n:
        order = order[:top_n]
    return [
        RerankResult(
            index=i,
            document=RerankResultDocument(documents[i]) if return_documents else None,
            relevance_score=scores[i],
        )
        for i in order
    ]
