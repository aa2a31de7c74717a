"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}, and
POST /v1/responses/{id}/cancel.

A request becomes chat-template messages: the instructions as a system message, then the stored
conversation of `previous_response_id` (its instructions are not carried over, as at OpenAI),
then the new input; its function tools reach the template as chat's do (`tools=`), and
`tool_choice` is planned as chat's (`sonar.http.tools.tool_plan`: "required" and a named function
enforced with structured outputs, "auto" parsed with --tool-call-parser). The generated text goes
through the same output parser as a chat choice's (thinking, content, calls), and
`sonar.http.responses_output` makes reasoning, message and function_call items of it. A
response is `completed`, or `incomplete` (reason `max_output_tokens`) when the token limit cut it.

Streamed, the events follow OpenAI's sequence, each with its `sequence_number` and an SSE
`event:` line: response.created, response.in_progress, then each item's events (added, deltas,
done), then response.completed (or response.incomplete / response.failed). The first event
waits for the engine's first output, so a request the engine refuses gets a proper 400. With
`store` (the default) the response is kept (`ResponseStore`) before its last event, with the
conversation so far: the next turn's input continues it.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Callable, Sequence

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from sonar.engine.llm import LLM
from sonar.http.chat import check_image_count, image_token, prompt_images, template_kwargs, template_source
from sonar.http.content_format import text_as_parts
from sonar.http.errors import error_from_exception
from sonar.http.messages import template_tools
from sonar.http.metrics import RequestRecorder, recorder
from sonar.http.outputs import batched, token_name
from sonar.http.protocol import RequestError
from sonar.http.request_log import log_delta, log_output, log_request
from sonar.http.response_store import ResponseStore
from sonar.http.responses import json_response
from sonar.http.responses_output import OutputItems, new_id
from sonar.http.responses_protocol import (
    IMAGES,
    INCLUDE_LOGPROBS,
    FunctionCallOutput,
    IncompleteDetails,
    InputTokensDetails,
    Logprob,
    OutputItem,
    OutputTokensDetails,
    ReasoningOutput,
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
    is_arguments,
)
from sonar.http.settings import ServerSettings
from sonar.http.sse import Emit, EventStream
from sonar.http.tasks import cancel_on_disconnect
from sonar.http.tools import ChoiceOutput, ChoicePiece, ToolPlan, choice_output, tool_plan
from sonar.log import get_logger
from sonar.protocol.engine import ImageInput, PositionLogprobs
from sonar.sampling_params import SamplingParams

log = get_logger("sonar.http")


class _Turn:
    """What one request needs while it runs: its parsed body, ids, the response it builds."""

    def __init__(
        self,
        rid: str,
        req: ResponsesRequest,
        settings: ServerSettings,
        params: SamplingParams,
        plan: ToolPlan,
        cache_block: int,
        model: str,
    ) -> None:
        """`cache_block`: the KV block size when the prefix cache is on, else 0; `model`: the name
        the response gives, the LoRA adapter's when the request runs with one."""
        self.req = req
        self.model = model
        self.cache_block = cache_block
        self.settings = settings
        self.params = params
        self.plan = plan
        self.id = rid
        self.text = req.text_config()
        self.created_at = int(time.time())
        self.conversation: list[dict[str, Any]] = []
        self.prompt_ids: list[int] = []
        self.images: list[ImageInput] = []
        #: The end of the prompt, where a reasoning parser sees whether thinking is already open.
        self.prompt_tail = ""

    def output(self) -> ChoiceOutput | None:
        """The parser of the generated text (None: it is all the message's text)."""
        return choice_output(self.plan, self.settings, self.prompt_tail)

    def response(
        self,
        status: str,
        output: list[OutputItem],
        usage: ResponseUsage | None = None,
        error: ResponseError | None = None,
    ) -> ResponseObject:
        req, params = self.req, self.params
        return ResponseObject(
            id=self.id,
            model=self.model,
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
            tools=req.tools or [],
            tool_choice=req.tool_choice or "auto",
            parallel_tool_calls=True if req.parallel_tool_calls is None else req.parallel_tool_calls,
            store=req.store is not False,
            metadata=req.metadata or {},
            user=req.user,
            usage=usage,
        )

    async def usage(
        self, llm: LLM, output: Sequence[OutputItem], output_tokens: int, cached_tokens: int
    ) -> ResponseUsage:
        """The usage; `reasoning_tokens` counts the thinking's text re-encoded (the markers
        around it, such as `<think>`, are not counted)."""
        n = len(self.prompt_ids)
        full = n // self.cache_block * self.cache_block if self.cache_block else 0
        details = InputTokensDetails(cached_tokens, max(0, full - cached_tokens))
        thinking = "".join(part.text for item in output if isinstance(item, ReasoningOutput) for part in item.content)
        reasoning = len(await llm.tokenize(thinking, add_special_tokens=False)) if thinking else 0
        return ResponseUsage(n, output_tokens, n + output_tokens, details, OutputTokensDetails(reasoning))

    def keep(self, store: ResponseStore, response: ResponseObject) -> None:
        """With `store`, keep a finished response (completed or incomplete) for GET and for the
        next turn."""
        if self.req.store is False or response.status == "failed":
            return
        conversation = [*self.conversation, *_assistant_turn(response.output)]
        evicted = store.put(self.id, msgspec.json.encode(response), conversation)
        if evicted:
            log.debug("responses.evicted", count=len(evicted), stored=len(store), bytes=store.bytes)


def _assistant_turn(output: Sequence[OutputItem]) -> list[dict[str, Any]]:
    """The output items as the next turn's template sees them: read as input items are (so that
    continuing with previous_response_id and sending the items back give one prompt), leaving out
    a call whose arguments are not a JSON object (the token limit cut them short)."""
    items = [
        msgspec.to_builtins(item)
        for item in output
        if not (isinstance(item, FunctionCallOutput) and not is_arguments(item.arguments))
    ]
    return input_messages(items, "output")


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


def _piece(parser: ChoiceOutput | None, text: str, last: bool) -> ChoicePiece:
    return ChoicePiece(content=text) if parser is None else parser.step(text, last)


def _plan(req: ResponsesRequest, settings: ServerSettings) -> tuple[ToolPlan, list[dict[str, Any]] | None]:
    """The request's tool plan and the tools the template gets; errors name the fields in the
    Responses shape (`tools[0].name`, `tool_choice.name`: chat nests them under `function`)."""
    try:
        tools = req.chat_tools()
        template = template_tools(tools)
        plan = tool_plan(req.chat_tool_choice(), tools, req.parallel_tool_calls, settings)
    except RequestError as exc:
        param = exc.param.replace(".function.", ".") if exc.param else exc.param
        raise RequestError(str(exc).replace(".function.", "."), param, exc.status, exc.code) from None
    if plan.mode == "none" and settings.exclude_tools_when_tool_choice_none:
        template = None
    if INCLUDE_LOGPROBS in (req.include or ()) and (plan.mode != "none" or settings.reasoning_parser):
        raise RequestError(
            f"include {INCLUDE_LOGPROBS!r} is not supported when the output is parsed into items (tools, or a "
            "server with --reasoning-parser): the tokens would not match the message's text",
            "include",
        )
    return plan, template


async def create_response(
    request: Request,
    llm: LLM,
    settings: ServerSettings,
    store: ResponseStore,
    check_model: Callable[[str | None], str | None],
) -> Response:
    rid = new_id("resp")
    request.state.request_id = rid  # the error handler names the request with it
    rec = recorder(request)
    req = decode_responses_request(await request.body())
    lora = check_model(req.model)
    req.check_refused()
    req.check_max_tokens(llm.info.max_model_len)
    plan, tools = _plan(req, settings)
    params = req.sampling_params(settings.default_sampling)
    rec.describe(params, lora or settings.model_name)
    plan.constrain(params)
    cache_block = llm.config.block_size if llm.config.enable_prefix_caching else 0
    turn = _Turn(rid, req, settings, params, plan, cache_block, lora or settings.model_name)
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
    # the images in prompt order: the stored turns' (sent again), then this input's
    urls = [(url, "previous_response_id") for m in history for url in m.get(IMAGES, ())]
    turn.conversation = [*history, *input_messages(req.input, image_token=image_token(llm), images=urls)]
    check_image_count(llm, urls, "input")
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    rendered = [{k: v for k, v in m.items() if k != IMAGES} for m in (*system, *turn.conversation)]
    prompt_ids = await llm.apply_chat_template(
        text_as_parts(rendered, settings.chat_template_content_format, template_source(llm, settings)),
        chat_template=settings.chat_template,
        tools=tools,
        chat_template_kwargs=template_kwargs(settings, None),
    )
    turn.prompt_ids, turn.images = await prompt_images(llm, settings, prompt_ids, urls, params.max_tokens)
    if settings.reasoning_parser:
        turn.prompt_tail = llm.tokenizer.decode(turn.prompt_ids[-8:])
    if settings.enable_log_requests:
        log_request(settings, turn.id, [llm.tokenizer.decode(turn.prompt_ids)], turn.params, lora=lora)
    if req.stream:
        return EventStream(lambda emit: _stream(emit, llm, store, turn, rec, lora), turn.id, done_marker=False)
    finished, result = await cancel_on_disconnect(
        request,
        lambda: rec.generate(llm, turn.prompt_ids, turn.params, request_id=turn.id, lora=lora, images=turn.images),
        turn.id,
    )
    if not finished:
        return Response(status_code=499)  # nobody reads it
    out = result.outputs[0]
    status = status_of(out.finish_reason)
    items = OutputItems()
    items.feed(
        _piece(turn.output(), out.text, True), _logprobs(out.logprobs or [], settings.return_tokens_as_token_ids)
    )
    items.finish("incomplete" if status == "failed" else status)
    log_output(settings, turn.id, [out.text], [out.finish_reason], len(out.token_ids))
    usage = await turn.usage(llm, items.items, len(out.token_ids), result.num_cached_tokens)
    response = turn.response(status, items.items, usage, _failure(out.finish_reason))
    turn.keep(store, response)
    return json_response(response)


async def _stream(
    emit: Emit, llm: LLM, store: ResponseStore, turn: _Turn, rec: RequestRecorder, lora: str | None
) -> None:
    settings = turn.settings
    numbers = itertools.count()

    async def send(make: type[StreamEvent], **fields: Any) -> None:
        event = make(sequence_number=next(numbers), **fields)
        await emit(event, event_name(event))

    async def send_all(events: list[tuple[type[StreamEvent], dict[str, Any]]]) -> None:
        for make, fields in events:
            await send(make, **fields)

    async def start() -> None:
        await send(ResponseCreated, response=turn.response("in_progress", []))
        await send(ResponseInProgress, response=turn.response("in_progress", []))

    items = OutputItems()
    parser = turn.output()
    text, output_tokens, cached_tokens = "", 0, 0
    finish_reason: str | None = None
    started = False
    as_ids = settings.return_tokens_as_token_ids
    deltas = rec.track(llm.stream(turn.prompt_ids, turn.params, request_id=turn.id, lora=lora, images=turn.images))
    try:
        async for d in batched(deltas, settings.stream_interval):
            log_delta(settings, turn.id, d)
            if not started:
                started = True
                await start()
            cached_tokens = max(cached_tokens, d.num_cached_tokens)
            output_tokens += len(d.token_ids)
            text += d.text
            if d.finish_reason is not None:
                finish_reason = d.finish_reason
            logprobs = _logprobs(d.logprobs or [], as_ids) if turn.params.logprobs is not None else []
            await send_all(items.feed(_piece(parser, d.text, d.finish_reason is not None), logprobs))
    except Exception as exc:
        if not started:  # nothing sent yet: answered as an ordinary error with its status
            raise
        _, body = error_from_exception(exc, turn.id)
        log.warning("request.stream_failed", request_id=turn.id, detail=body.error.message)
        items.finish("incomplete")
        failed = turn.response("failed", items.items, None, ResponseError("server_error", body.error.message))
        await send(ResponseFailed, response=failed)
        return
    if not started:
        await start()
    log_output(settings, turn.id, [text], [finish_reason], output_tokens)
    status = status_of(finish_reason)
    await send_all(items.finish("incomplete" if status == "failed" else status))
    usage = await turn.usage(llm, items.items, output_tokens, cached_tokens)
    response = turn.response(status, items.items, usage, _failure(finish_reason))
    turn.keep(store, response)
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
