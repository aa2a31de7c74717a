"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}, and
POST /v1/responses/{id}/cancel.

A request becomes chat-template messages: the instructions as a system message, then the stored
conversation of `previous_response_id` (its instructions are not carried over, as at OpenAI),
then the new input. The chat template renders them and the engine generates, as for a chat
completion. The answer is one assistant message item with one output_text part; its status is
`completed`, or `incomplete` (reason `max_output_tokens`) when the token limit cut it.

Streamed, the events follow OpenAI's sequence, each with its `sequence_number` and an SSE
`event:` line: response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta (one per engine output), then the
matching `.done` events and response.completed (or response.incomplete / response.failed). The
first event waits for the engine's first output, so a request the engine refuses gets a proper
400. With `store` (the default) the response is kept (`ResponseStore`) before its last event.
"""

from __future__ import annotations

import itertools
import secrets
import time
from typing import Any, Callable, Sequence

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from sonar.engine.llm import LLM
from sonar.http.errors import error_from_exception
from sonar.http.metrics import RequestRecorder, recorder
from sonar.http.outputs import batched, token_name
from sonar.http.protocol import RequestError
from sonar.http.request_log import log_delta, log_output, log_request
from sonar.http.response_store import ResponseStore
from sonar.http.responses import json_response
from sonar.http.responses_protocol import (
    ContentPartAdded,
    ContentPartDone,
    IncompleteDetails,
    InputTokensDetails,
    Logprob,
    OutputItemAdded,
    OutputItemDone,
    OutputMessage,
    OutputText,
    OutputTextDelta,
    OutputTextDone,
    OutputTokensDetails,
    ResponseCompleted,
    ResponseCreated,
    ResponseError,
    ResponseFailed,
    ResponseIncomplete,
    ResponseInProgress,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    StreamEvent,
    TopLogprob,
    decode_responses_request,
    event_name,
    input_messages,
)
from sonar.http.settings import ServerSettings
from sonar.http.sse import Emit, EventStream
from sonar.http.tasks import cancel_on_disconnect
from sonar.log import get_logger
from sonar.protocol.engine import PositionLogprobs
from sonar.sampling_params import SamplingParams

log = get_logger("sonar.http")


def _new_id(prefix: str) -> str:
    """OpenAI's id form for the Responses API: `resp_<hex>`, `msg_<hex>`."""
    return f"{prefix}_{secrets.token_hex(16)}"


class _Turn:
    """What one request needs while it runs: its parsed body, ids, the response it builds."""

    def __init__(
        self, rid: str, req: ResponsesRequest, settings: ServerSettings, params: SamplingParams, cache_block: int
    ) -> None:
        """`cache_block`: the KV block size when the prefix cache is on, else 0."""
        self.req = req
        self.cache_block = cache_block
        self.settings = settings
        self.params = params
        self.id = rid
        self.text = req.text_config()
        self.message_id = _new_id("msg")
        self.created_at = int(time.time())
        self.conversation: list[dict[str, Any]] = []
        self.prompt_ids: list[int] = []

    def response(
        self,
        status: str,
        output: list[OutputMessage],
        usage: ResponseUsage | None = None,
        error: ResponseError | None = None,
    ) -> ResponseObject:
        req, params = self.req, self.params
        return ResponseObject(
            id=self.id,
            model=self.settings.model_name,
            status=status,
            output=output,
            created_at=self.created_at,
            completed_at=int(time.time()) if status == "completed" else None,
            error=error,
            incomplete_details=IncompleteDetails("max_output_tokens") if status == "incomplete" else None,
            instructions=req.instructions,
            max_output_tokens=params.max_tokens,  # the request's, under the generation config's cap
            previous_response_id=req.previous_response_id,
            temperature=params.temperature,
            top_p=params.top_p,
            top_logprobs=req.top_logprobs,
            text=self.text,
            tool_choice=req.tool_choice or "auto",
            parallel_tool_calls=True if req.parallel_tool_calls is None else req.parallel_tool_calls,
            store=req.store is not False,
            metadata=req.metadata or {},
            user=req.user,
            usage=usage,
        )

    def message(self, status: str, text: str, logprobs: list[Logprob]) -> OutputMessage:
        return OutputMessage(self.message_id, status, [OutputText(text, [], logprobs)])

    def usage(self, output_tokens: int, cached_tokens: int) -> ResponseUsage:
        n = len(self.prompt_ids)
        full = n // self.cache_block * self.cache_block if self.cache_block else 0
        details = InputTokensDetails(cached_tokens, max(0, full - cached_tokens))
        return ResponseUsage(n, output_tokens, n + output_tokens, details, OutputTokensDetails())

    def keep(self, store: ResponseStore, response: ResponseObject, text: str) -> None:
        """With `store`, keep a finished response (completed or incomplete) for GET and for the
        next turn."""
        if self.req.store is False or response.status == "failed":
            return
        conversation = [*self.conversation, {"role": "assistant", "content": text}]
        evicted = store.put(self.id, msgspec.json.encode(response), conversation)
        if evicted:
            log.debug("responses.evicted", count=len(evicted), stored=len(store), bytes=store.bytes)


def status_of(finish_reason: str | None) -> str:
    """The response status a finish reason gives: stop → completed, length → incomplete (the
    token limit cut it), anything else (an abort at shutdown) → failed."""
    return {"stop": "completed", "length": "incomplete"}.get(finish_reason or "", "failed")


def _failure(finish_reason: str | None) -> ResponseError | None:
    if status_of(finish_reason) != "failed":
        return None
    return ResponseError("server_error", f"the request ended without finishing (finish reason {finish_reason!r})")


def _logprobs(positions: Sequence[PositionLogprobs], as_ids: bool) -> list[Logprob]:
    return [
        Logprob(
            token_name(p.token_id, p.token, as_ids),
            p.logprob,
            list(p.token.encode()),
            [TopLogprob(token_name(t.token_id, t.token, as_ids), t.logprob, list(t.token.encode())) for t in p.top],
        )
        for p in positions
    ]


async def create_response(
    request: Request,
    llm: LLM,
    settings: ServerSettings,
    store: ResponseStore,
    check_model: Callable[[str | None], None],
) -> Response:
    rid = _new_id("resp")
    request.state.request_id = rid  # the error handler names the request with it
    rec = recorder(request)
    req = decode_responses_request(await request.body())
    check_model(req.model)
    req.check_refused()
    req.check_max_tokens(llm.info.max_model_len)
    cache_block = llm.config.block_size if llm.config.enable_prefix_caching else 0
    turn = _Turn(rid, req, settings, req.sampling_params(settings.default_sampling), cache_block)
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        previous = store.get(req.previous_response_id)
        if previous is None:
            raise RequestError(
                f"Previous response with id '{req.previous_response_id}' not found (never stored, deleted, "
                "or evicted from the bounded store: --max-stored-responses, --max-stored-response-bytes).",
                "previous_response_id",
            )
        history = previous.conversation
    turn.conversation = [*history, *input_messages(req.input)]
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    turn.prompt_ids = await llm.apply_chat_template([*system, *turn.conversation], chat_template=settings.chat_template)
    if settings.enable_log_requests:
        log_request(settings, turn.id, [llm.tokenizer.decode(turn.prompt_ids)], turn.params)
    if req.stream:
        return EventStream(lambda emit: _stream(emit, llm, store, turn, rec), turn.id, done_marker=False)
    finished, result = await cancel_on_disconnect(
        request, lambda: rec.generate(llm, turn.prompt_ids, turn.params, request_id=turn.id), turn.id
    )
    if not finished:
        return Response(status_code=499)  # nobody reads it
    out = result.outputs[0]
    status = status_of(out.finish_reason)
    logprobs = _logprobs(out.logprobs or [], settings.return_tokens_as_token_ids)
    log_output(settings, turn.id, [out.text], [out.finish_reason], len(out.token_ids))
    response = turn.response(
        status,
        [turn.message("incomplete" if status == "failed" else status, out.text, logprobs)],
        turn.usage(len(out.token_ids), result.num_cached_tokens),
        _failure(out.finish_reason),
    )
    turn.keep(store, response, out.text)
    return json_response(response)


async def _stream(emit: Emit, llm: LLM, store: ResponseStore, turn: _Turn, rec: RequestRecorder) -> None:
    settings = turn.settings
    numbers = itertools.count()

    async def send(make: Callable[..., StreamEvent], **fields: Any) -> None:
        event = make(sequence_number=next(numbers), **fields)
        await emit(event, event_name(event))

    ids = dict(item_id=turn.message_id, output_index=0, content_index=0)

    async def start() -> None:
        await send(ResponseCreated, response=turn.response("in_progress", []))
        await send(ResponseInProgress, response=turn.response("in_progress", []))
        await send(OutputItemAdded, output_index=0, item=OutputMessage(turn.message_id, "in_progress", []))
        await send(ContentPartAdded, **ids, part=OutputText(""))

    text, logprobs, output_tokens, cached_tokens = "", [], 0, 0
    finish_reason: str | None = None
    started = False
    as_ids = settings.return_tokens_as_token_ids
    deltas = rec.track(llm.stream(turn.prompt_ids, turn.params, request_id=turn.id))
    try:
        async for d in batched(deltas, settings.stream_interval):
            log_delta(settings, turn.id, d)
            if not started:
                started = True
                await start()
            cached_tokens = max(cached_tokens, d.num_cached_tokens)
            output_tokens += len(d.token_ids)
            text += d.text
            piece = _logprobs(d.logprobs or [], as_ids) if turn.params.logprobs is not None else []
            logprobs += piece
            if d.finish_reason is not None:
                finish_reason = d.finish_reason
            if d.text or piece:
                await send(OutputTextDelta, **ids, delta=d.text, logprobs=piece)
    except Exception as exc:
        if not started:  # nothing sent yet: answered as an ordinary error with its status
            raise
        _, body = error_from_exception(exc, turn.id)
        log.warning("request.stream_failed", request_id=turn.id, detail=body.error.message)
        message = turn.message("incomplete", text, logprobs)
        failed = turn.response("failed", [message], None, ResponseError("server_error", body.error.message))
        await send(ResponseFailed, response=failed)
        return
    if not started:
        await start()
    log_output(settings, turn.id, [text], [finish_reason], output_tokens)
    status = status_of(finish_reason)
    message = turn.message("incomplete" if status == "failed" else status, text, logprobs)
    await send(OutputTextDone, **ids, text=text, logprobs=logprobs)
    await send(ContentPartDone, **ids, part=OutputText(text, [], logprobs))
    await send(OutputItemDone, output_index=0, item=message)
    response = turn.response(status, [message], turn.usage(output_tokens, cached_tokens), _failure(finish_reason))
    turn.keep(store, response, text)
    last = {"completed": ResponseCompleted, "incomplete": ResponseIncomplete}.get(status, ResponseFailed)
    await send(last, response=response)


# -- stored responses -----------------------------------------------------------------------------
def _stored(request: Request, store: ResponseStore) -> str:
    """The path's response id, known to the store (else 404); a query parameter is refused."""
    for name in request.query_params:
        raise RequestError(f"query parameter {name!r} is not supported", name)
    response_id = request.path_params["response_id"]
    if response_id not in store:
        raise RequestError(f"Response with id '{response_id}' not found.", "response_id", status=404)
    return response_id


async def get_response(request: Request, store: ResponseStore) -> Response:
    stored = store.get(_stored(request, store))
    assert stored is not None
    return Response(stored.response, media_type="application/json")


async def delete_response(request: Request, store: ResponseStore) -> Response:
    response_id = _stored(request, store)
    store.delete(response_id)
    return json_response({"id": response_id, "object": "response", "deleted": True})


async def cancel_response(request: Request, store: ResponseStore) -> Response:
    _stored(request, store)
    raise RequestError(
        "Only responses created with background set to true can be cancelled; this server runs none in the "
        "background (every response here has finished).",
        "response_id",
    )
