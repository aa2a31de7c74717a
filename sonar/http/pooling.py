"""The pooling endpoints: POST /v1/embeddings (OpenAI's), /pooling, /classify, /score (and
/v1/score) and /rerank (and /v1/rerank, /v2/rerank), vLLM's.

Each takes a request of up to `MAX_INPUTS` inputs (or documents), checks all of them (their shape,
the pooling parameters against what the model serves, each text's length and token ids) before any
runs, then runs them at once (the scheduler batches them) and answers in input order. A client
that leaves cancels what is still running. A model that is not a pooling model answers every one
with a 400 saying how to serve it as one. Scores are `sonar.engine.scoring`'s (a cross-encoder's
probability or the cosine similarity of two embeddings); see `sonar/http/pooling_protocol.py` for
the shapes.
"""

from __future__ import annotations

import time
from typing import Any, Callable, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from sonar.engine.gather import gather
from sonar.engine.llm import LLM, PoolingOutput
from sonar.engine.scoring import score
from sonar.errors import InvalidRequestError
from sonar.http.metrics import RequestRecorder, recorder
from sonar.http.pooling_protocol import (
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingData,
    PoolingRequest,
    PoolingResponse,
    RerankRequest,
    RerankResponse,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    check_pooling_params,
    classification,
    encode_data,
    rerank_results,
    usage,
)
from sonar.http.protocol import RequestError, decode_request
from sonar.http.request_log import check_user, log_request
from sonar.http.responses import json_response, new_id
from sonar.http.settings import ServerSettings
from sonar.http.tasks import cancel_on_disconnect
from sonar.pooling_params import PoolingInfo, PoolingParams

CheckModel = Callable[[str | None], str | None]
T = TypeVar("T")


def pooling_info(llm: LLM, path: str) -> PoolingInfo:
    """What the model serves; a 400 for a generative model."""
    info = llm.info.pooling
    if info is None:
        raise RequestError(
            f"{path} needs a pooling model, and this one generates text: serve an embedding, classification "
            "or reranking model with --runner pooling, or this one as an embedding model with --convert embed "
            "(per-token rewards: --convert reward)",
            "model",
        )
    return info


def check_inputs(llm: LLM, inputs: list[str | list[int]], param: str = "input") -> None:
    """Every input's length and token ids, before any runs."""
    for x in inputs:
        if isinstance(x, str):
            llm.check_prompt_chars(x, param)
        else:
            llm.check_token_ids(x, param)


def _fields(params: PoolingParams) -> dict[str, Any]:
    """The set pooling fields by name, for the request log line."""
    return {k: v for k, v in msgspec.structs.asdict(params).items() if v is not None}


def _record(rec: RequestRecorder, prompt_tokens: int) -> None:
    """A finished pooling request in the server's metrics: its prompt tokens, a success (finish
    reason "stop": a pooling request ends with its prompt), its latency."""
    m = rec.metrics
    m.prompt_tokens.inc(prompt_tokens)
    m.total_prompt_tokens += prompt_tokens
    m.request_success.labels(finished_reason="stop").inc()
    m.e2e.observe(time.monotonic() - rec.arrival)


async def _encode_all(
    request: Request,
    llm: LLM,
    settings: ServerSettings,
    rid: str,
    req: EmbeddingRequest | PoolingRequest | ClassificationRequest,
    lora: str | None,
    info: PoolingInfo,
    params: PoolingParams,
) -> list[PoolingOutput] | None:
    """Each input's `PoolingOutput`, in order, once all of them and `params` passed their checks
    (and the request was logged); None when the client left."""
    inputs = req.inputs()
    check_pooling_params(params, info)
    check_inputs(llm, inputs)
    log_request(settings, rid, inputs, _fields(params), user=req.user, lora=lora)
    rec = recorder(request)

    async def one(i: int, prompt: str | list[int]) -> PoolingOutput:
        out = await llm.encode(
            prompt,
            params,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
            priority=req.priority,
            request_id=f"{rid}-{i}",
            lora=lora,
        )
        _record(rec, len(out.prompt_token_ids))
        return out

    finished, outputs = await cancel_on_disconnect(
        request, lambda: gather([(lambda i=i, p=p: one(i, p)) for i, p in enumerate(inputs)]), rid
    )
    return outputs if finished else None


async def _prepare(
    request: Request,
    llm: LLM,
    settings: ServerSettings,
    check_model: CheckModel,
    kind: type[T],
    prefix: str,
) -> tuple[str, T, str | None, PoolingInfo]:
    """The request decoded and checked against the server: its id, itself, its adapter and what
    the model serves."""
    rid = new_id(prefix)
    request.state.request_id = rid  # the error handler names the request with it
    req = decode_request(await request.body(), kind)
    lora = check_model(req.model)  # type: ignore[attr-defined]
    check_user(settings, req.user)  # type: ignore[attr-defined]
    return rid, req, lora, pooling_info(llm, request.url.path)


async def create_embedding(request: Request, llm: LLM, settings: ServerSettings, check_model: CheckModel) -> Response:
    rid, req, lora, info = await _prepare(request, llm, settings, check_model, EmbeddingRequest, "embd")
    outputs = await _encode_all(request, llm, settings, rid, req, lora, info, req.pooling_params())
    if outputs is None:
        return Response(status_code=499)  # nobody reads it
    data = [EmbeddingData(index=i, embedding=encode_data(o.data, req.encoding_format)) for i, o in enumerate(outputs)]
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return json_response(EmbeddingResponse(id=rid, model=lora or settings.model_name, data=data, usage=usage(tokens)))


async def create_pooling(request: Request, llm: LLM, settings: ServerSettings, check_model: CheckModel) -> Response:
    rid, req, lora, info = await _prepare(request, llm, settings, check_model, PoolingRequest, "pool")
    outputs = await _encode_all(request, llm, settings, rid, req, lora, info, req.pooling_params(info))
    if outputs is None:
        return Response(status_code=499)
    data = [PoolingData(index=i, data=encode_data(o.data, req.encoding_format)) for i, o in enumerate(outputs)]
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return json_response(PoolingResponse(id=rid, model=lora or settings.model_name, data=data, usage=usage(tokens)))


async def create_classification(
    request: Request, llm: LLM, settings: ServerSettings, check_model: CheckModel
) -> Response:
    rid, req, lora, info = await _prepare(request, llm, settings, check_model, ClassificationRequest, "classify")
    outputs = await _encode_all(request, llm, settings, rid, req, lora, info, req.pooling_params())
    if outputs is None:
        return Response(status_code=499)
    data = [classification(i, o.data.tolist(), info.labels) for i, o in enumerate(outputs)]
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return json_response(
        ClassificationResponse(id=rid, model=lora or settings.model_name, data=data, usage=usage(tokens))
    )


async def _score(
    request: Request,
    llm: LLM,
    rid: str,
    req: ScoreRequest | RerankRequest,
    lora: str | None,
    queries: list[str],
    documents: list[str],
    names: tuple[str, str],
) -> list | None:
    """`scoring.score` of the pairs, its errors naming the request's fields; None when the client left."""
    rec = recorder(request)

    async def run() -> list:
        try:
            results = await score(
                llm,
                queries,
                documents,
                truncate_prompt_tokens=req.truncate_prompt_tokens,
                use_activation=req.use_activation,
                priority=req.priority,
                lora=lora,
                request_id=rid,
            )
        except InvalidRequestError as exc:
            renamed = {"queries": names[0], "documents": names[1]}
            exc.param = renamed.get(exc.param, exc.param) if exc.param else exc.param
            raise
        for r in results:
            _record(rec, r.prompt_tokens)
        return results

    finished, results = await cancel_on_disconnect(request, run, rid)
    return results if finished else None


async def create_score(request: Request, llm: LLM, settings: ServerSettings, check_model: CheckModel) -> Response:
    rid, req, lora, _ = await _prepare(request, llm, settings, check_model, ScoreRequest, "score")
    queries, documents = req.pairs()
    names = ("queries", "documents") if req.queries is not None or req.documents is not None else ("text_1", "text_2")
    log_request(settings, rid, [*queries, *documents], None, user=req.user, lora=lora)
    results = await _score(request, llm, rid, req, lora, queries, documents, names)
    if results is None:
        return Response(status_code=499)
    data = [ScoreData(index=r.index, score=r.score) for r in results]
    tokens = sum(r.prompt_tokens for r in results)
    return json_response(ScoreResponse(id=rid, model=lora or settings.model_name, data=data, usage=usage(tokens)))


async def create_rerank(request: Request, llm: LLM, settings: ServerSettings, check_model: CheckModel) -> Response:
    rid, req, lora, _ = await _prepare(request, llm, settings, check_model, RerankRequest, "rerank")
    documents = req.texts()
    log_request(settings, rid, [req.query, *documents], None, user=req.user, lora=lora)
    results = await _score(request, llm, rid, req, lora, [req.query], documents, ("query", "documents"))
    if results is None:
        return Response(status_code=499)
    ranked = rerank_results([r.score for r in results], documents, req.top_n, req.return_documents)
    tokens = sum(r.prompt_tokens for r in results)
    return json_response(RerankResponse(id=rid, model=lora or settings.model_name, usage=usage(tokens), results=ranked))
