"""`python -m sonar serve`: parse the flags, start the engine, serve the OpenAI API until a signal.

SIGTERM or SIGINT drains the server: new requests get 503 (`/health` too), the requests in flight
get `--shutdown-timeout` seconds to finish (default 0: none), then the rest are aborted (they end
with finish_reason "abort"; streams with a last chunk saying so, then `[DONE]`). Then uvicorn and
the engine stop and the process exits 0. A second signal aborts at once; a third forces the exit.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from sonar.cli.config import ServeConfig
from sonar.cli.errors import PROG, HelpRequested, UsageError
from sonar.cli.parse import parse_serve_args


def main(argv: Sequence[str]) -> int:
    """Run `sonar serve` with `argv` (the words after `serve`); returns the exit code."""
    try:
        config = parse_serve_args(argv)
    except HelpRequested as request:
        sys.stdout.write(request.text)
        return request.exit_code
    except UsageError as error:
        print(error, file=sys.stderr)
        return error.exit_code
    import anyio

    code = anyio.run(serve, config, backend="asyncio")
    if _is_process_entry():
        _exit_now(code)
    return code


def _is_process_entry() -> bool:
    """True when this process is `python -m sonar` (not a test or a program calling `main`)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return spec is not None and spec.name == "sonar.__main__"


def _exit_now(code: int) -> None:
    """Exit without the interpreter's teardown. Everything is stopped and flushed by now; what is
    left is freeing the model's memory object by object, which takes about a second on a small
    model and would make `--shutdown-timeout 0` slow to exit. The atexit handlers still run."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _say(line: str) -> None:
    print(f"{PROG}: {line}", flush=True)


async def serve(config: ServeConfig) -> int:
    """Open the engine, serve HTTP until SIGTERM/SIGINT, shut everything down; the exit code."""
    import anyio
    import msgspec
    import uvicorn

    import sonar
    from sonar.http.app import build_app
    from sonar.http.common import Drain, FrontDoor

    started_at = time.monotonic()
    for line in describe(config):
        _say(line)
    holder: dict[str, Any] = {}
    drain = Drain()
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with anyio.create_task_group() as tg:

            async def watch_signals() -> None:
                async for sig in signals:
                    server = holder.get("server")
                    _say(f"{signal.Signals(sig).name}: " + ("shutting down" if not drain.draining else "stopping now"))
                    if server is None:  # still starting: stop the start
                        tg.cancel_scope.cancel()
                        return
                    waiting = holder.get("waiting")
                    if not drain.draining:
                        holder["waiting"] = anyio.CancelScope()
                        tg.start_soon(shut_down, server, holder["llm"], holder["waiting"])
                    elif waiting is not None and not waiting.cancel_called:
                        waiting.cancel()  # second signal: abort what is still running now
                    else:
                        server.should_exit = server.force_exit = True

            async def shut_down(server: Any, llm: Any, waiting: Any) -> None:
                drain.draining = True
                if drain.in_flight:
                    _say(f"draining: {drain.in_flight} request(s) in flight, "
                         f"up to {config.shutdown_timeout:g} s to finish")
                with waiting:
                    with anyio.move_on_after(config.shutdown_timeout):
                        await drain.wait_idle()
                await _abort_rest(drain, llm)
                server.should_exit = True

            tg.start_soon(watch_signals)
            args = msgspec.structs.asdict(config.engine)
            model = args.pop("model")
            try:
                async with sonar.open(model, **args) as llm:
                    for line in startup_summary(config, llm, time.monotonic() - started_at):
                        _say(line)
                    app = build_app(llm, _settings(config), log_stats_interval=None if config.disable_log_stats else 10.0)
                    app = FrontDoor(app, drain, request_id_headers=config.enable_request_id_headers)
                    server = _make_server(uvicorn.Config(app, **_uvicorn_args(config)))
                    _quiet_access_log(config.disable_access_log_for_endpoints)
                    holder["llm"] = llm
                    holder["server"] = server
                    try:
                        await server.serve()
                    finally:
                        if config.uds and os.path.exists(config.uds):  # uvicorn leaves the socket file
                            os.unlink(config.uds)
            except Exception as exc:
                print(f"{PROG}: error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                tg.cancel_scope.cancel()
                return 1
            tg.cancel_scope.cancel()
    _say("stopped")
    return 0


async def _abort_rest(drain: Any, llm: Any, patience: float = 3.0) -> None:
    """End the requests still in flight with finish_reason "abort", and wait (up to `patience`
    seconds) for their responses to go out. Repeated, for requests still tokenizing the first time."""
    import anyio

    from sonar.http.common import abort_all

    aborted: set[str] = set()
    with anyio.move_on_after(patience):
        while drain.in_flight:
            aborted.update(await abort_all(llm))
            with anyio.move_on_after(0.1):
                await drain.wait_idle(0.01)
    if aborted:
        _say(f"aborted {len(aborted)} request(s) still running")


def _quiet_access_log(paths: Sequence[str]) -> None:
    """--disable-access-log-for-endpoints: drop uvicorn's access log lines for these paths (the
    query string aside). Installed after uvicorn has configured its loggers."""
    import logging

    quiet = {p.strip() for p in paths if p.strip()}
    if not quiet:
        return

    class Quiet(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            args = record.args
            if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
                return args[2].split("?", 1)[0] not in quiet
            return True

    logging.getLogger("uvicorn.access").addFilter(Quiet())


def _make_server(uvicorn_config: Any) -> Any:
    """A uvicorn `Server` without its own signal handling: `serve()` handles the signals, and
    uvicorn would re-raise them when it returns."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return Server(uvicorn_config)


def _settings(config: ServeConfig) -> Any:
    from sonar.http.common import ServerSettings

    return ServerSettings(
        served_model_names=config.served_model_name, api_keys=config.api_key or (),
        chat_template=_chat_template(config.chat_template), response_role=config.response_role,
        allowed_origins=config.allowed_origins, allowed_methods=config.allowed_methods,
        allowed_headers=config.allowed_headers, allow_credentials=config.allow_credentials,
        enable_force_include_usage=config.enable_force_include_usage,
        enable_prompt_tokens_details=config.enable_prompt_tokens_details,
        enable_request_id_headers=config.enable_request_id_headers,
        system_fingerprint=system_fingerprint(config), stream_interval=config.stream_interval,
        return_tokens_as_token_ids=config.return_tokens_as_token_ids,
        default_sampling=generation_defaults(config),
        enable_tokenizer_info_endpoint=config.enable_tokenizer_info_endpoint,
        enable_log_requests=config.enable_log_requests, enable_log_outputs=config.enable_log_outputs,
        max_log_len=config.max_log_len)


#: generation_config.json keys that become sampling defaults, and their SamplingParams names.
GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens",
                   "max_tokens": "max_tokens"}


def generation_defaults(config: ServeConfig) -> dict[str, Any]:
    """`--generation-config` and `--override-generation-config` as SamplingParams defaults.

    'auto' reads generation_config.json from the model's folder (none for the embedded model or
    a model that has no such file), a folder path reads it from there (it must exist), 'sonar'
    (or 'vllm') reads none. The override is merged over what was read."""
    import json

    source = config.generation_config
    found: dict[str, Any] = {}
    if source == "auto":
        model = config.engine.model
        folder = model if model is not None and os.path.isdir(model) else None
    elif source in ("sonar", "vllm", "aphrodite"):
        folder = None
    else:
        folder = source
        if not os.path.isfile(os.path.join(folder, "generation_config.json")):
            raise FileNotFoundError(f"--generation-config {source}: no generation_config.json there")
    if folder is not None:
        path = os.path.join(folder, "generation_config.json")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                found = json.load(f)
    merged = {**found, **config.override_generation_config}
    defaults = {GENERATION_KEYS[k]: v for k, v in merged.items() if k in GENERATION_KEYS and v is not None}
    if defaults:
        _say("sampling defaults from the generation config: "
             + ", ".join(f"{k}={v}" for k, v in sorted(defaults.items())))
    return defaults


def system_fingerprint(config: ServeConfig) -> str | None:
    """`--fingerprint-mode`: full and hash give `sonar-<version>-<hash8>` (8 hex digits of the
    engine configuration's sha256; full would add parallelism degrees above 1, and Sonar runs
    none), custom the `--fingerprint-value` text, none null."""
    import hashlib

    import msgspec

    import sonar

    if config.fingerprint_mode == "none":
        return None
    if config.fingerprint_mode == "custom":
        return config.fingerprint_value
    digest = hashlib.sha256(msgspec.json.encode(config.engine)).hexdigest()[:8]
    return f"sonar-{sonar.__version__}-{digest}"


def _chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file's path or the template itself."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    return value


def _uvicorn_args(config: ServeConfig) -> dict[str, Any]:
    args: dict[str, Any] = dict(
        log_level=config.uvicorn_log_level, access_log=not config.disable_uvicorn_access_log,
        # serve() drains and aborts before it tells uvicorn to exit; this only bounds the rest.
        timeout_graceful_shutdown=2.0,
        h11_max_incomplete_event_size=config.h11_max_incomplete_event_size,
        ssl_keyfile=config.ssl_keyfile, ssl_certfile=config.ssl_certfile, ssl_ca_certs=config.ssl_ca_certs,
        ssl_cert_reqs=config.ssl_cert_reqs, root_path=config.root_path or "",
    )
    if config.uds:
        args["uds"] = config.uds
    else:
        args["host"] = config.host or "0.0.0.0"
        args["port"] = config.port
    return args


def startup_summary(config: ServeConfig, llm: Any, seconds: float) -> list[str]:
    """What was loaded, how big its KV cache is (and the flag that reproduces it), where to call it."""
    info = llm.info
    tokens = info.num_blocks * info.block_size
    return [
        f"engine ready in {seconds:.1f} s: {info.model} ({info.architecture}), dtype {info.dtype}",
        f"max model len: {info.max_model_len}",
        f"KV cache: {info.num_blocks} blocks of {info.block_size} tokens ({tokens} tokens); "
        f"reproduce with --kv-cache-memory-bytes {info.kv_cache_memory_bytes}",
        f"serving {', '.join(config.served_model_name)} at {_address(config)}",
    ]


def _address(config: ServeConfig) -> str:
    if config.uds:
        return f"unix:{config.uds}"
    scheme = "https" if config.ssl_certfile else "http"
    return f"{scheme}://{config.host or '0.0.0.0'}:{config.port}"


def describe(config: ServeConfig) -> list[str]:
    """One line per setting that decides what gets served and where."""
    engine = config.engine
    lines = [f"model: {_model(config)}", f"served model name: {', '.join(config.served_model_name)}"]
    lines.append(f"dtype: {engine.dtype}")
    if engine.max_model_len is None:
        length = "from the model's config"
    elif engine.max_model_len == -1:
        length = "auto (the longest that fits the KV cache)"
    else:
        length = str(engine.max_model_len)
    lines.append(f"max model len: {length}")
    if config.uds:
        lines.append(f"listening on: unix:{config.uds}")
    else:
        scheme = "https" if config.ssl_certfile else "http"
        where = f"{config.host}:{config.port}" if config.host else f"0.0.0.0:{config.port} (all interfaces)"
        lines.append(f"listening on: {scheme}://{where}")
    placement = ", ".join(f"{actor}={where}" for actor, where in engine.describe_placement().items())
    lines.append(f"placement: {placement}")
    if config.accepted_noops:
        lines.append(f"accepted, no effect in Sonar: {', '.join(config.accepted_noops)}")
    return lines


def _model(config: ServeConfig) -> str:
    if config.model is not None:
        return config.model
    from sonar.models.embedded import EMBEDDED_NAME, EmbeddedModelMissing, gguf_path

    try:
        return f"{EMBEDDED_NAME} (embedded: {gguf_path()})"
    except EmbeddedModelMissing as exc:
        return f"{EMBEDDED_NAME} (embedded; {exc})"
