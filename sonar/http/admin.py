"""The operator's routes: sleep mode and the profiler.

    POST /sleep?level=1|2[&timeout=S]   free the KV cache, move (1) or drop (2) the weights
    POST /wake_up[?tags=weights&tags=kv_cache]
    GET  /is_sleeping                   {"is_sleeping": bool}
    POST /start_profile, /stop_profile  torch's profiler in the workers
    POST /update_weights                new weights: {"path": DIR}, or a safetensors body
                                        (Content-Type application/octet-stream) of tensors

Each maps onto the `LLM` method of the same name: a server started without the feature's flag
(``--enable-sleep-mode``, ``--profiler-config``, ``--weight-transfer-config``) answers 404 naming
it (`NotEnabledError`).
Like every route but the health probes they need the API key when one is set; without one, the
routes that change the engine (all but /is_sleeping) answer only a client on this machine (403
otherwise), as vLLM keeps them to its development mode: whoever reaches the port must not be able
to put the server to sleep or swap its weights. While the engine
sleeps, generation requests get 503 (`EngineSleepingError`); a sleep the running requests do not
leave time for (``timeout``, default 60 s) gets 409 and changes nothing. A weight update that does
not fit the served model gets 400, one that cannot happen now 409; neither changes anything; a safetensors body is bounded by
``--max-request-body-bytes`` (bigger updates go through the library, `LLM.update_weights`).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import anyio.to_thread
import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Scope

from sonar.core.sleep import SleepState
from sonar.core.weights import WeightUpdateError
from sonar.engine.llm import LLM, SLEEP_DRAIN_TIMEOUT
from sonar.http.protocol import RequestError, decode_request
from sonar.http.responses import json_response

Handler = Callable[[Request], Awaitable[Response]]


def _params(request: Request, allowed: Iterable[str]) -> None:
    """Refuse a query parameter the route does not take."""
    unknown = sorted(set(request.query_params) - set(allowed))
    if unknown:
        raise RequestError(f"unknown query parameter {unknown[0]!r} for {request.url.path}", unknown[0])


def _number(request: Request, name: str, kind: type, default: float) -> float:
    text = request.query_params.get(name)
    if text is None:
        return default
    try:
        return kind(text)
    except ValueError:
        raise RequestError(f"{name} must be a{'n integer' if kind is int else ' number'}, got {text!r}", name) from None


def _state(state: SleepState) -> Response:
    return json_response({"is_sleeping": state.is_sleeping, "level": state.level, "asleep": list(state.asleep)})


class UpdateWeightsRequest(msgspec.Struct, forbid_unknown_fields=True):
    path: str


def _safetensors_body(body: bytes) -> dict[str, Any]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return load(body)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise WeightUpdateError(f"the request body is not a safetensors file: {exc}") from None


def trusted_client(scope: Scope, api_keys: tuple[str, ...]) -> bool:
    """With API keys: the request showed one. Without: the client is on this machine (a loopback
    address, or the Unix socket, whose file permissions decide who connects)."""
    if api_keys:
        return bool(scope.get("state", {}).get("authenticated"))
    client = scope.get("client")
    if not client:
        return True
    try:
        return ipaddress.ip_address(client[0]).is_loopback
    except ValueError:
        return False


def _trusted_only(handler: Handler, api_keys: tuple[str, ...]) -> Handler:
    async def guarded(request: Request) -> Response:
        if not trusted_client(request.scope, api_keys):
            raise RequestError(
                f"{request.url.path} changes the engine: without --api-key only a client on the server's "
                "machine may call it",
                status=403,
            )
        return await handler(request)

    return guarded


def admin_routes(llm: LLM, api_keys: tuple[str, ...] = ()) -> list[Route]:
    async def sleep(request: Request) -> Response:
        _params(request, ("level", "timeout"))
        level = _number(request, "level", int, 1)
        timeout = _number(request, "timeout", float, SLEEP_DRAIN_TIMEOUT)
        return _state(await llm.sleep(int(level), drain_timeout=timeout))

    async def wake_up(request: Request) -> Response:
        _params(request, ("tags",))
        tags = request.query_params.getlist("tags") or None
        return _state(await llm.wake_up(tags))

    async def is_sleeping(request: Request) -> Response:
        _params(request, ())
        return json_response({"is_sleeping": await llm.is_sleeping()})

    async def start_profile(request: Request) -> Response:
        _params(request, ())
        await llm.start_profile()
        return json_response({"profiling": True})

    async def stop_profile(request: Request) -> Response:
        _params(request, ())
        return json_response({"profiling": False, "traces": await llm.stop_profile()})

    async def update_weights(request: Request) -> Response:
        _params(request, ())
        llm.weight_transfer()  # off: 404 naming the flag, before the body is looked at
        body = await request.body()
        if request.headers.get("content-type", "").startswith("application/octet-stream"):
            tensors = await anyio.to_thread.run_sync(_safetensors_body, body)
            updated = await llm.update_weights(tensors=tensors)
        else:
            updated = await llm.update_weights(decode_request(body, UpdateWeightsRequest).path)
        return json_response(msgspec.to_builtins(updated))

    changes = {
        "/update_weights": update_weights,
        "/sleep": sleep,
        "/wake_up": wake_up,
        "/start_profile": start_profile,
        "/stop_profile": stop_profile,
    }
    return [
        *(Route(path, _trusted_only(handler, api_keys), methods=["POST"]) for path, handler in changes.items()),
        Route("/is_sleeping", is_sleeping, methods=["GET"]),
    ]
