"""POST /v1/completions: one or more prompts (text or token ids), n completions each.

Choice `i` of prompt `p` has index `p * n + i`, as OpenAI and vLLM number them. Usage counts
each prompt's tokens once (not once per completion) and every completion token.

`echo` with `max_tokens: 0` scores the prompt: each choice's text is the prompt, with its logprobs
when `logprobs` is set (the first token's is null: nothing precedes it), and no completion tokens.
The engine samples one token to get there, which the response leaves out (`_scored`).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from starlette.requests import Request
from starlette.responses import Response

from sonar.engine.gather import gather
from sonar.engine.llm import LLM, RequestOutput
from sonar.engine.prompt_embeds import load_serialized
from sonar.http.metrics import RequestRecorder, recorder
from sonar.http.outputs import batched, completion_logprobs, make_usage, merge_completion_logprobs
from sonar.http.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    RequestError,
    decode_request,
)
from sonar.http.request_log import check_user, log_delta, log_output, log_request
from sonar.http.responses import json_response, new_id
from sonar.http.settings import ServerSettings
from sonar.http.sse import Emit, EventStream
from sonar.http.tasks import cancel_on_disconnect
from sonar.sampling_params import SamplingParams


async def create_completion(
    request: Request, llm: LLM, settings: ServerSettings, check_model: Callable[[str | None], str | None]
) -> Response:
    rid = new_id("cmpl")
    request.state.request_id = rid  # the error handler names the request with it
    rec = recorder(request)
    req = decode_request(await request.body(), CompletionRequest)
    lora = check_model(req.model)
    check_user(settings, req.user)
    prompts = embeds_prompts(req, llm) if req.prompt_embeds is not None else req.prompts()
    for prompt in prompts:  # every prompt before any starts (a stream would have begun)
        if isinstance(prompt, list):
            llm.check_token_ids(prompt)
    req.check_max_tokens(llm.info.max_model_len)
    params = req.sampling_params(settings.default_sampling)
    rec.describe(params, lora or settings.model_name)
    llm.check_completions(len(prompts), params)
    for prompt in prompts:  # every prompt before any starts (a stream would have begun)
        if isinstance(prompt, str):
            llm.check_prompt_chars(prompt)
    log_request(settings, rid, [_loggable(p) for p in prompts], params, user=req.user, lora=lora)
    if req.stream:
        return EventStream(lambda emit: _stream(emit, llm, settings, req, prompts, params, rid, rec, lora), rid)
    finished, outputs = await cancel_on_disconnect(
        request,
        lambda: gather(
            [
                (
                    lambda p=p, i=i: rec.generate(
                        llm,
                        p,
                        params,
                        i,
                        priority=req.priority,
                        cache_salt=req.cache_salt,
                        request_id=f"{rid}-{i}",
                        lora=lora,
                    )
                )
                for i, p in enumerate(prompts)
            ]
        ),
        rid,
    )
    if not finished:
        return Response(status_code=499)  # nobody reads it
    if req.scores_only:
        outputs = [_scored(result) for result in outputs]
    response = _response(llm, settings, req, rid, outputs, params.n, lora or settings.model_name)
    if settings.enable_per_request_metrics and len(prompts) == 1 and params.n == 1:
        response.metrics = rec.timing()
    log_output(
        settings,
        rid,
        [c.text for c in response.choices],
        [c.finish_reason for c in response.choices],
        response.usage.completion_tokens if response.usage else 0,
    )
    return json_response(response)


def embeds_prompts(req: CompletionRequest, llm: LLM) -> list[Any]:
    """The request's `prompt_embeds` as `{"prompt_embeds": tensor}` prompts; decoded only on a
    server started with --enable-prompt-embeds (`sonar.engine.prompt_embeds`)."""
    if not llm.config.enable_prompt_embeds:
        raise RequestError("prompt_embeds needs a server started with --enable-prompt-embeds", "prompt_embeds")
    if req.prompt is not None:
        raise RequestError("give either prompt or prompt_embeds, not both", "prompt_embeds")
    if req.echo:
        raise RequestError("echo needs the prompt's text, which prompt_embeds do not have", "echo")
    given = [req.prompt_embeds] if isinstance(req.prompt_embeds, str) else req.prompt_embeds
    if not given:
        raise RequestError("prompt_embeds must not be empty", "prompt_embeds")
    info = llm.info
    return [{"prompt_embeds": load_serialized(text, info.hidden_size, info.max_model_len)} for text in given]


def _loggable(prompt: Any) -> Any:
    """What the request log shows of a prompt: an embeddings prompt as its shape."""
    if isinstance(prompt, dict):
        return f"<prompt_embeds {list(prompt['prompt_embeds'].shape)}>"
    return prompt


def _scored(result: RequestOutput) -> RequestOutput:
    """`result` without what was generated: what echo with max_tokens 0 answers."""
    for out in result.outputs:
        out.text, out.token_ids, out.logprobs, out.finish_reason, out.stop_reason = "", [], [], "length", None
    return result


def _prompt_text(llm: LLM, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else llm.tokenizer.decode(prompt)


def _first_token_text(llm: LLM, prompt_ids: list[int], as_ids: bool = False) -> list[str]:
    return [f"token_id:{prompt_ids[0]}"] if as_ids and prompt_ids else [llm.tokenizer.decode(prompt_ids[:1])]


def _response(
    llm: LLM,
    settings: ServerSettings,
    req: CompletionRequest,
    rid: str,
    outputs: list[RequestOutput],
    n: int,
    model: str,
) -> CompletionResponse:
    """`model`: the name the response gives, the adapter's when the request ran with one."""
    choices = []
    prompt_tokens = completion_tokens = cached_tokens = 0
    as_ids = settings.return_tokens_as_token_ids
    for p, result in enumerate(outputs):
        prompt_tokens += len(result.prompt_token_ids)
        cached_tokens += result.num_cached_tokens
        prompt_text = (
            (result.prompt if result.prompt is not None else llm.tokenizer.decode(result.prompt_token_ids))
            if req.echo
            else ""
        )
        for out in result.outputs:
            completion_tokens += len(out.token_ids)
            logprobs = None
            if req.logprobs is not None:
                logprobs = completion_logprobs(out.logprobs or [], offset=len(prompt_text), as_ids=as_ids)
                if req.echo:
                    scored = completion_logprobs(
                        result.prompt_logprobs or [],
                        _first_token_text(llm, result.prompt_token_ids, as_ids),
                        as_ids=as_ids,
                    )
                    logprobs = merge_completion_logprobs(scored, logprobs)
            choices.append(
                CompletionChoice(
                    p * n + out.index, prompt_text + out.text, logprobs, out.finish_reason, out.stop_reason
                )
            )
    usage = make_usage(settings, prompt_tokens, completion_tokens, cached_tokens)
    return CompletionResponse(
        id=rid, model=model, choices=choices, usage=usage, system_fingerprint=settings.system_fingerprint
    )


async def _stream(
    emit: Emit,
    llm: LLM,
    settings: ServerSettings,
    req: CompletionRequest,
    prompts: list[str | list[int]],
    params: SamplingParams,
    rid: str,
    rec: RequestRecorder,
    lora: str | None,
) -> None:
    created = int(time.time())
    model = lora or settings.model_name
    counts = {"prompt": 0, "completion": 0, "cached": 0}
    texts: dict[int, str] = {}
    finished: dict[int, str | None] = {}
    as_ids = settings.return_tokens_as_token_ids

    def chunk(choice: CompletionChoice) -> CompletionResponse:
        return CompletionResponse(
            id=rid,
            model=model,
            choices=[choice],
            created=created,
            system_fingerprint=settings.system_fingerprint,
        )

    async def one(p: int, prompt: str | list[int]) -> None:
        echo_pending = set(range(params.n)) if req.echo else set()
        prompt_text = _prompt_text(llm, prompt) if req.echo else ""
        offsets = [len(prompt_text)] * params.n
        counted = False
        cached = 0
        deltas = rec.track(
            llm.stream(
                prompt, params, priority=req.priority, cache_salt=req.cache_salt, request_id=f"{rid}-{p}", lora=lora
            ),
            p,
        )
        async for d in batched(deltas, settings.stream_interval):
            if req.scores_only:
                d.text, d.token_ids, d.logprobs, d.stop_reason = "", [], [], None
                d.finish_reason = "length" if d.finish_reason is not None else None
            log_delta(settings, rid, d)
            if not counted and d.num_prompt_tokens:
                counts["prompt"] += d.num_prompt_tokens
                counted = True
            if d.num_cached_tokens > cached:
                counts["cached"] += d.num_cached_tokens - cached
                cached = d.num_cached_tokens
            counts["completion"] += len(d.token_ids)
            text = d.text
            logprobs: CompletionLogprobs | None = None
            if req.logprobs is not None:
                logprobs = completion_logprobs(d.logprobs or [], offset=offsets[d.index], as_ids=as_ids)
                if req.echo and d.prompt_logprobs:
                    first = _first_token_text(
                        llm, prompt if isinstance(prompt, list) else llm.tokenizer(prompt).input_ids, as_ids
                    )
                    scored = completion_logprobs(d.prompt_logprobs, first, as_ids=as_ids)
                    logprobs = merge_completion_logprobs(scored, logprobs)
            if d.index in echo_pending:
                echo_pending.discard(d.index)
                text = prompt_text + text
            offsets[d.index] += len(d.text)
            texts[p * params.n + d.index] = texts.get(p * params.n + d.index, "") + text
            if d.finish_reason is not None:
                finished[p * params.n + d.index] = d.finish_reason
            if text or d.finish_reason is not None or (logprobs and logprobs.tokens):
                await emit(
                    chunk(CompletionChoice(p * params.n + d.index, text, logprobs, d.finish_reason, d.stop_reason))
                )

    await gather([(lambda p=p, prompt=prompt: one(p, prompt)) for p, prompt in enumerate(prompts)])
    order = sorted(texts)
    log_output(settings, rid, [texts[i] for i in order], [finished.get(i) for i in order], counts["completion"])
    if req.include_usage or settings.enable_force_include_usage:
        usage = make_usage(settings, counts["prompt"], counts["completion"], counts["cached"])
        last = CompletionResponse(
            id=rid,
            model=model,
            choices=[],
            usage=usage,
            created=created,
            system_fingerprint=settings.system_fingerprint,
        )
        if settings.enable_per_request_metrics and len(prompts) == 1 and params.n == 1:
            last.metrics = rec.timing()
        await emit(last)
