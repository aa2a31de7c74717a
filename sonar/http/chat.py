"""POST /v1/chat/completions: the chat template renders the messages, then the engine generates.

The messages and tools reach the template as `sonar.http.messages` shapes them, with the request's
`chat_template_kwargs` over --default-chat-template-kwargs; with `tool_choice: "none"` and
--exclude-tools-when-tool-choice-none the tools stay out of the prompt. What `tool_choice` asks of
the output (`sonar.http.tools.plan_tools`): nothing ("none"), tool calls parsed from the text
("auto"), or calls enforced with structured outputs ("required", a named function).

Streamed, each choice's first chunk carries the role (sent when the engine's first output
arrives, so that a rejected request still gets a proper 400), then content chunks, the last one
with the finish reason; with `stream_options.include_usage` a final chunk carries the usage.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any, Callable

from starlette.requests import Request
from starlette.responses import Response

from sonar.engine.llm import LLM
from sonar.http.content_format import shape_content
from sonar.http.messages import EmbedsPart, MediaSource, template_messages, template_tools
from sonar.http.metrics import RequestRecorder, recorder
from sonar.http.outputs import batched, chat_logprobs, make_usage
from sonar.http.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    DeltaMessage,
    RequestError,
    ResponseMessage,
    Usage,
    decode_request,
)
from sonar.http.request_log import check_user, log_delta, log_output, log_request
from sonar.http.responses import json_response, new_id
from sonar.http.settings import ServerSettings
from sonar.http.sse import Emit, EventStream
from sonar.http.tasks import cancel_on_disconnect
from sonar.http.tools import ChoiceOutput, choice_output, finish_reason, plan_tools, whole_message
from sonar.multimodal.media import MediaPolicy, decode_image, fetch_image_bytes
from sonar.protocol.engine import ImageInput
from sonar.sampling_params import SamplingParams


async def create_chat_completion(
    request: Request, llm: LLM, settings: ServerSettings, check_model: Callable[[str | None], str | None]
) -> Response:
    rid = new_id("chatcmpl")
    request.state.request_id = rid  # the error handler names the request with it
    rec = recorder(request)
    req = decode_request(await request.body(), ChatCompletionRequest)
    lora = check_model(req.model)
    check_user(settings, req.user)
    req.check_max_tokens(llm.info.max_model_len)
    params = req.sampling_params(settings.default_sampling)
    rec.describe(params, lora or settings.model_name)
    if req.add_generation_prompt and req.continue_final_message:
        raise RequestError(
            "add_generation_prompt and continue_final_message cannot both be set (set add_generation_prompt to false)",
            "continue_final_message",
        )
    tools = template_tools(req.tools)
    plan = plan_tools(req, settings)
    plan.constrain(params, req.skip_special_tokens)
    media: list[tuple[MediaSource, str]] = []
    source = template_source(llm, settings)
    messages = shape_content(
        template_messages(req.messages, source, image_token(llm), media),
        req.messages,
        settings.chat_template_content_format,
        source,
    )
    check_image_count(llm, media, "messages")
    if plan.mode == "none" and settings.exclude_tools_when_tool_choice_none:
        tools = None
    prompt_ids = await llm.apply_chat_template(
        messages,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        chat_template=settings.chat_template,
        tools=tools,
        chat_template_kwargs=template_kwargs(settings, req.chat_template_kwargs),
    )
    prompt_ids, images = await prompt_images(llm, settings, prompt_ids, media, params.max_tokens)
    if settings.enable_log_requests:
        log_request(settings, rid, [llm.tokenizer.decode(prompt_ids)], params, user=req.user, lora=lora)
    role = settings.response_role if req.add_generation_prompt else req.messages[-1].role
    # A reasoning parser needs to know whether the prompt left a thinking block open.
    prompt_tail = llm.tokenizer.decode(prompt_ids[-8:]) if settings.reasoning_parser else ""

    def output() -> ChoiceOutput | None:
        return choice_output(plan, settings, prompt_tail)

    if req.stream:
        return EventStream(
            lambda emit: _stream(emit, llm, settings, req, prompt_ids, params, role, rid, rec, output, lora, images),
            rid,
        )
    finished, result = await cancel_on_disconnect(
        request,
        lambda: rec.generate(
            llm,
            prompt_ids,
            params,
            priority=req.priority,
            cache_salt=req.cache_salt,
            request_id=rid,
            lora=lora,
            images=images,
        ),
        rid,
    )
    if not finished:
        return Response(status_code=499)  # nobody reads it
    choices = []
    for out in result.outputs:
        parser = output()
        choices.append(
            ChatChoice(
                out.index,
                ResponseMessage(role, out.text) if parser is None else whole_message(parser, out.text, role),
                chat_logprobs(out.logprobs or [], settings.return_tokens_as_token_ids) if req.logprobs else None,
                finish_reason(out.finish_reason, parser.calls_made if parser else 0),
                out.stop_reason,
            )
        )
    completion_tokens = sum(len(out.token_ids) for out in result.outputs)
    log_output(
        settings, rid, [out.text for out in result.outputs], [c.finish_reason for c in choices], completion_tokens
    )
    usage = make_usage(settings, len(prompt_ids), completion_tokens, result.num_cached_tokens)
    response = ChatCompletionResponse(
        id=rid,
        model=lora or settings.model_name,
        choices=choices,
        usage=usage,
        system_fingerprint=settings.system_fingerprint,
    )
    if settings.enable_per_request_metrics and params.n == 1:
        response.metrics = rec.timing()
    return json_response(response)


def template_source(llm: LLM, settings: ServerSettings) -> str | None:
    """The chat template's source: --chat-template, else the tokenizer's (all of its named
    templates, when it has several)."""
    source = settings.chat_template or getattr(llm.tokenizer, "chat_template", None)
    return "\n".join(source.values()) if isinstance(source, dict) else source


def check_image_count(llm: LLM, media: list[tuple[MediaSource, str]], param: str) -> None:
    """A 400 when a request brings more images than --limit-mm-per-prompt allows (images given as
    feature rows count as `LLM.counted_images` says)."""
    count = llm.counted_images(len(media), _given(media))
    if count > llm.image_limit:
        raise RequestError(f"at most {llm.image_limit} image(s) per prompt (--limit-mm-per-prompt), got {count}", param)


async def prompt_images(
    llm: LLM,
    settings: ServerSettings,
    prompt_ids: list[int],
    media: list[tuple[MediaSource, str]],
    max_tokens: int | None,
) -> tuple[list[int], list[ImageInput]]:
    """The rendered prompt with each image's placeholder expanded, and the images: `media` are
    ``(source, param)`` in prompt order, URLs loaded under the server's media policy and
    ``image_embeds`` parts read (a bad one is a 400 naming its `param`). Without images, the
    prompt as it is."""
    if not media:
        return prompt_ids, []
    llm.check_images(prompt_ids, len(media), max_tokens, embeds=_given(media))
    policy = MediaPolicy(settings.allowed_local_media_path, settings.allowed_media_domains, image_io=llm.image_io)
    return await llm.add_images(prompt_ids, await _load_media(llm, media, policy))


def _given(media: list[tuple[MediaSource, str]]) -> int:
    """How many of the images are given as feature rows."""
    return sum(isinstance(source, EmbedsPart) for source, _ in media)


async def _load_media(llm: LLM, media: list[tuple[MediaSource, str]], policy: MediaPolicy) -> list[Any]:
    """The prompt's images in order: fetched, decoded and preprocessed (URLs; a picture seen before
    comes from the processed cache), or read as feature rows (``image_embeds`` parts)."""
    out: list[Any] = []
    for source, where in media:
        if isinstance(source, EmbedsPart):
            out.append(llm.read_image_embeds(source.value, where))
        else:
            data = await fetch_image_bytes(source, policy, where)
            out.append(await llm.prepare_image(data, partial(decode_image, policy=policy, param=where)))
    return out


def image_token(llm: LLM) -> str | None:
    """The text of the model's image token, which stands for an image in the rendered chat; None
    for a model that takes no images."""
    vision = llm.info.vision
    if vision is None:
        return None
    return vision.image_text or llm.tokenizer.convert_ids_to_tokens(vision.image_token_id)


def template_kwargs(settings: ServerSettings, given: dict[str, Any] | None) -> dict[str, Any]:
    """The template's extra variables: the request's `chat_template_kwargs` over
    --default-chat-template-kwargs."""
    return {**settings.default_chat_template_kwargs, **(given or {})}


async def _stream(
    emit: Emit,
    llm: LLM,
    settings: ServerSettings,
    req: ChatCompletionRequest,
    prompt_ids: list[int],
    params: SamplingParams,
    role: str,
    rid: str,
    rec: RequestRecorder,
    output: Callable[[], ChoiceOutput | None],
    lora: str | None,
    images: list[ImageInput],
) -> None:
    created = int(time.time())

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=rid,
            model=lora or settings.model_name,
            choices=choices,
            created=created,
            usage=usage,
            system_fingerprint=settings.system_fingerprint,
        )

    completion_tokens = cached_tokens = 0
    texts: dict[int, str] = {}
    finished: dict[int, str | None] = {}
    started = False
    parsers = {i: output() for i in range(params.n)}
    deltas = rec.track(
        llm.stream(
            prompt_ids,
            params,
            priority=req.priority,
            cache_salt=req.cache_salt,
            request_id=rid,
            lora=lora,
            images=images,
        )
    )
    async for d in batched(deltas, settings.stream_interval):
        log_delta(settings, rid, d)
        cached_tokens = max(cached_tokens, d.num_cached_tokens)
        if not started:
            started = True
            for i in range(params.n):
                await emit(chunk([ChatChunkChoice(i, DeltaMessage(role=role, content=""))]))
        completion_tokens += len(d.token_ids)
        texts[d.index] = texts.get(d.index, "") + d.text
        if d.finish_reason is not None:
            finished[d.index] = d.finish_reason
        as_ids = settings.return_tokens_as_token_ids
        logprobs = chat_logprobs(d.logprobs, as_ids) if req.logprobs and d.logprobs else None
        parser = parsers.get(d.index)
        if parser is None:
            delta, reason = DeltaMessage(content=d.text), d.finish_reason
            send = bool(d.text)
        else:
            piece = parser.step(d.text, last=d.finish_reason is not None)
            delta, reason = parser.delta(piece), finish_reason(d.finish_reason, parser.calls_made)
            send = bool(piece)
        if send or d.finish_reason is not None or logprobs is not None:
            await emit(chunk([ChatChunkChoice(d.index, delta, logprobs, reason, d.stop_reason)]))
    order = sorted(texts)
    log_output(settings, rid, [texts[i] for i in order], [finished.get(i) for i in order], completion_tokens)
    if req.include_usage or settings.enable_force_include_usage:
        last = chunk([], make_usage(settings, len(prompt_ids), completion_tokens, cached_tokens))
        if settings.enable_per_request_metrics and params.n == 1:
            last.metrics = rec.timing()
        await emit(last)
