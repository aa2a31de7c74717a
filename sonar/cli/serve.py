"""`python -m sonar serve`: parse the flags, start the engine, serve the OpenAI API until a signal.

SIGTERM or SIGINT drains the server: new requests get 503 (`/health` too), the requests in flight
get `--shutdown-timeout` seconds to finish (default 0: none), then the rest are aborted (they end
with finish_reason "abort"; streams with a last chunk saying so, then `[DONE]`). Then uvicorn and
the engine stop and the process exits 0. A second signal aborts at once; a third forces the exit.
"""

from __future__ import annotations

import importlib
import os
import shutil
import signal
import sys
import threading
import time
from typing import Any, Sequence

from sonar import heap
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
    from sonar.cli.environ import unknown_variables

    for problem in unknown_variables(os.environ):
        if config.fail_on_environ_validation:
            print(f"{PROG}: error: {problem} (--fail-on-environ-validation)", file=sys.stderr)
            return 2
        _say(f"warning: {problem}")
    if config.log_config_file is not None:
        from sonar.log import LogConfigError, use_config_file

        try:
            use_config_file(config.log_config_file)
        except LogConfigError as error:
            print(f"{PROG}: error: {error}", file=sys.stderr)
            return 2
    if config.middleware:  # the operator's modules import now, before a model loads, or the start stops
        from sonar.http.middleware import MiddlewareError, load_middleware

        try:
            load_middleware(config.middleware)
        except MiddlewareError as error:
            print(f"{PROG}: error: {error}", file=sys.stderr)
            return 2
    if config.engine.logits_processors:  # likewise: a name that does not import stops the start here
        from sonar.engine.logits_processors import LogitsProcessorError, load_classes

        try:
            load_classes(config.engine.logits_processors)
        except LogitsProcessorError as error:
            print(f"{PROG}: error: {error}", file=sys.stderr)
            return 2
    import anyio

    from sonar.actors import configure_transport
    from sonar.actors.keys import KeysError

    try:
        configure_transport(config.actor_keys, config.actor_max_frame_bytes)
    except KeysError as error:
        print(f"sonar serve: {error}", file=sys.stderr)
        return 2
    if config.headless:
        return _headless(config)
    shared_metrics = None
    if (config.api_server_count or 1) > 1:
        from sonar.cli.api_servers import share_metrics

        shared_metrics = share_metrics()
    try:
        with heap.starting():  # `import_behind` settles it
            code = anyio.run(serve, config, backend="asyncio")
    finally:
        if shared_metrics is not None:
            shutil.rmtree(shared_metrics, ignore_errors=True)
    if _is_process_entry():
        _exit_now(code)
    return code


def _headless(config: ServeConfig) -> int:
    """A secondary node: keep this node's ranks' (or data-parallel replicas') actor hosts up (no API
    server, no engine here) until the head is gone or SIGTERM/SIGINT."""
    from sonar.engine.node_agent import NodesError, run_data_parallel_headless, run_headless
    from sonar.engine.nodes import local_replicas

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    engine = config.engine
    run = run_headless
    if engine.nnodes > 1:
        _say(
            f"headless node {engine.node_rank} of {engine.nnodes}: rendezvous at "
            f"{engine.master_addr}:{engine.master_port}"
        )
    else:
        mine = local_replicas(engine)
        _say(
            f"headless node of data-parallel replicas {mine.start} .. {mine.stop - 1} of {engine.data_parallel_size}: "
            f"rendezvous at {engine.data_parallel_address}:{engine.data_parallel_rpc_port}"
        )
        run = run_data_parallel_headless
    try:
        code = run(engine, config.actor_keys, config.actor_max_frame_bytes, stop)
    except NodesError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr, flush=True)
        return 1
    _say("stopped" if code == 0 else f"exiting with code {code}")
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


def server_engine_config(config: ServeConfig) -> Any:
    """The engine configuration `serve` runs: the worker in a child process unless `--placement`
    says where (a crash or a hang of the model then takes only that process down)."""
    import msgspec

    engine = config.engine
    if "worker" in engine.placement:
        return engine
    return msgspec.structs.replace(engine, placement={**engine.placement, "worker": "process"})


def root_spec(config: ServeConfig, listening: threading.Event | None = None, settings: Any = None) -> Any:
    """The server's supervision tree: the frontend (uvicorn), then the engine, then with
    `--api-server-count` N > 1 the other N - 1 API servers (`sonar.cli.api_servers`; `settings`:
    the app's `ServerSettings` they serve with, by default `_settings(config)`).

    Restart intensity 0: the engine's own supervisor restarts what crashed inside it (and the API
    servers' supervisor the API server processes); when it gives up, or the frontend dies, the
    root gives up too and the process exits 1 (so an orchestrator restarts the server rather
    than believing it ended well)."""
    from sonar.actors import ChildSpec, InProcess, SupervisorSpec
    from sonar.engine.replicas import data_parallel_spec
    from sonar.http.frontend import FrontendActor

    count = config.api_server_count or 1
    shared = {
        "request_id_headers": config.enable_request_id_headers,
        "max_header_count": config.h11_max_header_count,
        "quiet_paths": list(config.disable_access_log_for_endpoints),
        "header_timeout": config.header_read_timeout,
        "max_connections": config.max_connections,
        "ssl_refresh": config.enable_ssl_refresh,
    }
    frontend = ChildSpec(
        "frontend",
        FrontendActor,
        placement=InProcess(),
        ping_interval=2.0,
        ping_timeout=15.0,
        shutdown=5.0,
        kwargs={
            "uvicorn_args": _uvicorn_args(config),
            **shared,
            "listening": listening,
            "server_index": 0 if count > 1 else None,
        },
    )
    others = []
    if count > 1:
        from sonar.cli.api_servers import api_servers_spec

        others.append(
            api_servers_spec(
                count,
                _uvicorn_args(config),
                shared,
                settings or _settings(config),
                config.middleware,
                server_engine_config(config),
                config.served_model_name[0],
            )
        )
    return SupervisorSpec(
        "sonar",
        [frontend, data_parallel_spec(server_engine_config(config)), *others],
        strategy="one_for_one",
        max_restarts=0,
        period=60,
    )


async def serve(config: ServeConfig) -> int:
    """Start the root supervisor (frontend, engine), serve HTTP until SIGTERM/SIGINT, shut down;
    the exit code."""
    import anyio
    import anyio.to_thread
    import msgspec

    from sonar.actors import supervise
    from sonar.actors.supervisor import SupervisorGaveUp
    from sonar.cli.api_servers import feed, tell_all
    from sonar.engine.nodes import replicas_spread
    from sonar.http.frontend import ServeApp, SetPhase

    started_at = time.monotonic()
    listening = threading.Event()
    importing = import_behind(config, listening)
    for line in describe(config):
        _say(line)
    warning = exposure_warning(config)
    if warning is not None:
        from sonar.log import get_logger

        get_logger("sonar.serve").warning(
            "serve.unauthenticated", host=config.host or "0.0.0.0", port=config.port, detail=warning
        )
    phase = "starting"  # this side's view: the frontend owns the phase (`SetPhase` moves it)
    finished = anyio.Event()
    waiting = anyio.CancelScope()
    code = 0
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with anyio.create_task_group() as tg:

            async def watch_signals() -> None:
                nonlocal phase
                async for sig in signals:
                    _say(f"{signal.Signals(sig).name}: " + ("shutting down" if phase == "serving" else "stopping now"))
                    if phase == "serving":
                        phase = "draining"
                        tg.start_soon(shut_down)
                    elif phase == "draining" and not waiting.cancel_called:
                        waiting.cancel()  # second signal: abort what is still running now
                    else:  # still starting, or a third signal: stop at once
                        tg.cancel_scope.cancel()
                        return

            async def shut_down() -> None:
                root = holder["root"]
                in_flight = sum(s.in_flight for s in await tell_all(root, SetPhase("draining")))
                if in_flight:
                    _say(f"draining: {in_flight} request(s) in flight, up to {config.shutdown_timeout:g} s to finish")
                with waiting:
                    with anyio.move_on_after(config.shutdown_timeout):
                        await _wait_idle(root)
                await _abort_rest(root, holder["llm"])
                finished.set()

            holder: dict[str, Any] = {}
            tg.start_soon(watch_signals)
            try:
                if config.engine.nnodes > 1:  # the head: the other nodes report before the ranks start
                    from sonar.engine.node_agent import open_head

                    holder["rendezvous"], engine_config = await anyio.to_thread.run_sync(
                        open_head, config.engine, abandon_on_cancel=True
                    )
                    config = msgspec.structs.replace(config, engine=engine_config)
                elif replicas_spread(config.engine):  # the head: the replicas' nodes report first
                    from sonar.engine.node_agent import open_data_parallel_head

                    holder["rendezvous"], engine_config = await anyio.to_thread.run_sync(
                        open_data_parallel_head, config.engine, abandon_on_cancel=True
                    )
                    config = msgspec.structs.replace(config, engine=engine_config)
                settings = _settings(config)
                async with supervise(root_spec(config, listening, settings)) as root:
                    holder["root"] = root
                    frontend = root.child("frontend").ref
                    engine = root.child("engine").child
                    if replicas_spread(config.engine):  # its nodes report their replicas' ended hosts
                        from sonar.engine.node_agent import watch_replica_hosts

                        tg.start_soon(watch_replica_hosts, holder["rendezvous"], engine, config.engine)
                    if (config.api_server_count or 1) > 1:
                        tg.start_soon(feed, root, engine)
                    await anyio.to_thread.run_sync(importing.join)
                    from sonar.engine.client import connect
                    from sonar.http.app import build_app
                    from sonar.http.metrics import stats_logging

                    async with connect(engine, server_engine_config(config), config.served_model_name[0]) as llm:
                        llm.root = root
                        holder["llm"] = llm

                        def on_event(event: Any) -> None:
                            nonlocal phase
                            if event.kind == "give_up":
                                phase = "dead"
                                tg.start_soon(tell_all, root, SetPhase("dead", "it gave up after repeated crashes"))
                                _say(
                                    f"error: the engine gave up ({event.detail}); failing requests with 503 and exiting"
                                )

                        engine.listeners.append(on_event)
                        for line in startup_summary(config, llm, time.monotonic() - started_at):
                            _say(line)
                        app = build_app(llm, settings)
                        status = await _tell(frontend, ServeApp(app))
                        if phase == "starting" and status is not None and status.phase == "serving":
                            phase = "serving"
                        interval = None if config.disable_log_stats else 10.0
                        async with stats_logging(llm, app.state.metrics, interval):
                            await finished.wait()
            except SupervisorGaveUp as exc:
                print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
                code = 1
            except Exception as exc:
                print(f"{PROG}: error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                code = 1
            tg.cancel_scope.cancel()
    _say("stopped" if code == 0 else f"exiting with code {code}")
    return code


SERVING_MODULES = (
    "sonar.engine.client",
    "sonar.engine.detokenizer",
    "sonar.engine.scheduler",
    "sonar.http.app",
    "sonar.http.metrics",
)
"""What this process imports to serve besides the supervision tree's spec (torch, the HTTP app,
the engine's in-process actors)."""


def import_behind(config: ServeConfig, listening: threading.Event, patience: float = 10.0) -> threading.Thread:
    """Import `SERVING_MODULES`, then prefetch the tokenizers, in a thread that starts once the
    frontend is `listening` (or after `patience` seconds): the supervision tree starts the worker
    process next, so its imports and model load run beside these instead of after them (and the
    frontend's own start does not wait on them). A failed import is left for the importer in the
    main thread to raise. Then it settles this process's heap (`sonar.heap`), which holds most of
    what the start builds here by now: its collection runs while the worker still loads."""

    def run() -> None:
        listening.wait(patience)
        try:
            for module in SERVING_MODULES:
                importlib.import_module(module)
            from sonar.engine import tokenizers

            tokenizers.prefetch_for(server_engine_config(config))
        except Exception as exc:
            _say(f"warning: importing ahead failed: {type(exc).__name__}: {exc}")
        finally:
            settled = heap.settle()
            if settled is not None:
                from sonar.log import get_logger

                get_logger("sonar.serve").info(
                    "heap.settled", frozen=settled.frozen, seconds=round(settled.seconds, 3), pid=os.getpid()
                )

    thread = threading.Thread(target=run, name="import-behind", daemon=True)
    thread.start()
    return thread


async def _tell(frontend: Any, msg: Any) -> Any:
    """The frontend's `FrontendStatus` after `msg` (through its `ActorRef`), or None when it is
    gone: the root then stops the server, and nothing is left to serve or drain."""
    from sonar.actors import ActorError, ActorNotFound, AskTimeout

    try:
        return await frontend.ask(msg, timeout=5.0)
    except (ActorError, ActorNotFound, AskTimeout):
        return None


async def _in_flight(root: Any) -> int:
    """The HTTP requests the API servers (the frontend, and any others) are answering."""
    from sonar.cli.api_servers import tell_all
    from sonar.http.frontend import GetFrontendStatus

    return sum(status.in_flight for status in await tell_all(root, GetFrontendStatus()))


async def _wait_idle(root: Any, poll: float = 0.05) -> None:
    """Until the API servers answer no HTTP request."""
    import anyio

    while await _in_flight(root):
        await anyio.sleep(poll)


async def _abort_rest(root: Any, llm: Any, patience: float = 3.0) -> None:
    """End the requests still in flight on every API server with finish_reason "abort", and wait
    (up to `patience` seconds) for their responses to go out. Repeated, for requests still
    tokenizing the first time."""
    import anyio

    from sonar.cli.api_servers import abort_others
    from sonar.http.lifecycle import abort_all

    aborted: set[str] = set()
    with anyio.move_on_after(patience):
        while await _in_flight(root):
            aborted.update(await abort_all(llm))
            aborted.update(await abort_others(root))
            with anyio.move_on_after(0.1):
                await _wait_idle(root, 0.01)
    if aborted:
        _say(f"aborted {len(aborted)} request(s) still running")


def _settings(config: ServeConfig) -> Any:
    from sonar.http.middleware import load_middleware
    from sonar.http.settings import ServerSettings

    return ServerSettings(
        served_model_names=config.served_model_name,
        middleware=tuple(load_middleware(config.middleware)),
        chat_template_content_format=config.chat_template_content_format,
        api_keys=config.api_key or (),
        chat_template=_chat_template(config.chat_template),
        default_chat_template_kwargs=dict(config.default_chat_template_kwargs or {}),
        exclude_tools_when_tool_choice_none=config.exclude_tools_when_tool_choice_none,
        response_role=config.response_role,
        allowed_local_media_path=config.allowed_local_media_path,
        allowed_media_domains=config.allowed_media_domains,
        allowed_origins=config.allowed_origins,
        allowed_methods=config.allowed_methods,
        allowed_headers=config.allowed_headers,
        allow_credentials=config.allow_credentials,
        enable_force_include_usage=config.enable_force_include_usage,
        enable_prompt_tokens_details=config.enable_prompt_tokens_details,
        enable_request_id_headers=config.enable_request_id_headers,
        system_fingerprint=system_fingerprint(config),
        stream_interval=config.stream_interval,
        return_tokens_as_token_ids=config.return_tokens_as_token_ids,
        default_sampling=generation_defaults(config),
        enable_tokenizer_info_endpoint=config.enable_tokenizer_info_endpoint,
        enable_log_requests=config.enable_log_requests,
        enable_log_outputs=config.enable_log_outputs,
        max_log_len=config.max_log_len,
        enable_openapi=not config.disable_fastapi_docs,
        enable_log_deltas=config.enable_log_deltas,
        metrics_public=config.metrics_public,
        max_request_body_bytes=config.max_request_body_bytes,
        body_read_timeout=config.body_read_timeout,
        max_stored_responses=config.max_stored_responses,
        max_stored_response_bytes=config.max_stored_response_bytes,
        enable_auto_tool_choice=config.enable_auto_tool_choice,
        tool_call_parser=config.tool_call_parser,
        reasoning_parser=config.reasoning_parser or None,
        log_error_stack=config.log_error_stack,
        enable_per_request_metrics=config.enable_per_request_metrics,
        otlp_traces_endpoint=config.otlp_traces_endpoint,
        enable_server_load_tracking=config.enable_server_load_tracking,
    )


#: generation_config.json keys that become sampling defaults, and their SamplingParams names.
GENERATION_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
    "max_tokens": "max_tokens",
}


def generation_defaults(config: ServeConfig) -> dict[str, Any]:
    """`--generation-config` and `--override-generation-config` as SamplingParams defaults.

    'auto' reads generation_config.json from the model's folder, or from its snapshot in the local
    Hugging Face cache for a model id (none for the embedded model or a model that has no such
    file), a folder path reads it from there (it must exist), 'sonar'
    (or 'vllm') reads none. The override is merged over what was read."""
    import json

    source = config.generation_config
    found: dict[str, Any] = {}
    if source == "auto":
        folder = _model_folder(config)
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
        _say(
            "sampling defaults from the generation config: "
            + ", ".join(f"{k}={v}" for k, v in sorted(defaults.items()))
        )
    return defaults


def _model_folder(config: ServeConfig) -> str | None:
    """The served model's folder: the path given, or a hub id's snapshot in the local cache."""
    engine = config.engine
    model = engine.model
    if model is None:
        return None
    if os.path.isdir(model):
        return model
    from sonar.models.loader import _REPO_ID, ModelLoadError, _resolve_hub_cache

    if not _REPO_ID.match(model):
        return None
    try:
        return str(_resolve_hub_cache(model, engine.revision, engine.download_dir)[0])
    except ModelLoadError:
        return None  # loading the model reports it


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
        log_level=config.uvicorn_log_level,
        access_log=not config.disable_uvicorn_access_log,
        # serve() drains and aborts before it tells uvicorn to exit; this only bounds the rest.
        timeout_graceful_shutdown=2.0,
        h11_max_incomplete_event_size=config.h11_max_incomplete_event_size,
        ssl_keyfile=config.ssl_keyfile,
        ssl_certfile=config.ssl_certfile,
        ssl_ca_certs=config.ssl_ca_certs,
        ssl_cert_reqs=config.ssl_cert_reqs,
        root_path=config.root_path or "",
    )
    if config.log_config_file is not None:  # uvicorn applies its own logging config otherwise
        from sonar.log import read_config_file

        args["log_config"] = read_config_file(config.log_config_file)
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
    replicas = config.engine.data_parallel_size
    each = f" in each of {replicas} replicas" if replicas > 1 else ""
    offload, events = config.engine.offload_config(), config.engine.kv_events()
    kv_lines = []
    if offload is not None:
        tiers = ", ".join(
            f"{t.medium.upper()} {t.size_bytes / 2**30:g} GiB" + (f" at {t.path}" if t.path else "")
            for t in offload.tiers
        )
        kv_lines.append(
            f"KV offloading: {offload.spec_name}: {tiers}; chunks of {offload.blocks_per_chunk} "
            f"block(s) ({offload.blocks_per_chunk * info.block_size} tokens), {offload.eviction_policy}"
        )
    if events is not None:
        replay = f", replay at {events.replay_endpoint}" if events.replay_endpoint else ""
        kv_lines.append(f"KV events: published at {events.endpoint}{replay} (topic {events.topic!r})")
    return kv_lines + [
        f"engine ready in {seconds:.1f} s: {info.model} ({info.architecture}), dtype {info.dtype}",
        f"max model len: {info.max_model_len}",
        f"KV cache: {info.num_blocks} blocks of {info.block_size} tokens ({tokens} tokens){each}; "
        f"reproduce with --kv-cache-memory-bytes {info.kv_cache_memory_bytes * replicas}",
        f"serving {', '.join(config.served_model_name)} at {_address(config)}",
        "startup: "
        + " ".join(f"{phase}={secs:.2f}" for phase, secs in [*info.startup_seconds.items(), ("ready", seconds)]),
    ]


def exposure_warning(config: ServeConfig) -> str | None:
    """What to tell the operator when the server listens beyond this machine with no API key
    (None when it does not: a loopback address, a Unix socket, or --api-key set)."""
    import ipaddress

    if config.uds or config.api_key:
        return None
    host = config.host or "0.0.0.0"
    try:
        if host == "localhost" or ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        pass  # a host name: it may resolve to any interface
    where = "all interfaces" if host in ("0.0.0.0", "::") else host
    return (
        f"listening on {where} without --api-key: anyone who can reach port {config.port} can generate, "
        "tokenize and read /metrics and /actors; set --api-key, or --host 127.0.0.1 behind a proxy "
        "(see docs/security.md)"
    )


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
    placed = server_engine_config(config).describe_placement()  # where the actors run, not the flag
    placement = ", ".join(f"{actor}={where}" for actor, where in placed.items())
    lines.append(f"placement: {placement}")
    if (config.api_server_count or 1) > 1:
        lines.append(
            f"API servers: {config.api_server_count} processes sharing the port (SO_REUSEPORT) over one engine"
        )
    if engine.data_parallel_size > 1:
        from sonar.engine.nodes import local_replicas

        here = len(local_replicas(engine))
        where = "" if here == engine.data_parallel_size else f" ({here} here, the others on headless nodes)"
        lines.append(
            f"data parallel: {engine.data_parallel_size} replicas{where}, requests routed by "
            f"{engine.data_parallel_routing}"
        )
    if config.enable_auto_tool_choice:
        lines.append(f"tool calls: tool_choice 'auto' parsed with {config.tool_call_parser}")
    if config.reasoning_parser:
        lines.append(f"reasoning parser: {config.reasoning_parser}")
    return lines


def _model(config: ServeConfig) -> str:
    if config.model is not None:
        return config.model
    from sonar.models.embedded import EMBEDDED_NAME, EmbeddedModelMissing, gguf_path

    try:
        return f"{EMBEDDED_NAME} (embedded: {gguf_path()})"
    except EmbeddedModelMissing as exc:
        return f"{EMBEDDED_NAME} (embedded; {exc})"
