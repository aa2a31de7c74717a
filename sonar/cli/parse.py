"""`parse_serve_args(argv) -> ServeConfig`: the `serve` command line, a `--config` file and defaults.

Order of precedence: command line, then the config file, then each flag's default. JSON flags
may also be set one key at a time (`sonar.cli.dotted`). Help is looked for first, so `--help`
works whatever else is on the line. Errors raise `UsageError` (one line, exit code 2); help
raises `HelpRequested` (its text, exit code 0).
"""

from __future__ import annotations

import argparse
import copy
import difflib
import json
import os
from functools import lru_cache
from typing import Any, Sequence

from sonar.cli.config import ServeConfig
from sonar.cli.dotted import DottedKey, merge_key, split_dotted
from sonar.cli.errors import PROG, HelpRequested, UsageError
from sonar.cli.flags import Flag, Kind, Status
from sonar.cli.parsers import check_parser_flags
from sonar.cli.table import BY_DEST, BY_OPTION, FLAGS
from sonar.cli.values import convert, convert_element

_MODEL_POSITIONAL = "model_tag"


class _ArgumentParser(argparse.ArgumentParser):
    """argparse, but errors raise `UsageError` (one line, no usage dump) instead of exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError.bad(message)

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]
        raise UsageError(message.strip() if message else f"{PROG}: error: exit {status}")


def _type(flag: Flag, element: bool = False):
    def parse(text: str) -> Any:
        try:
            return convert_element(flag, text) if element else convert(flag, text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = flag.kind.value  # argparse names the type in some messages
    return parse


@lru_cache(maxsize=1)
def build_parser() -> argparse.ArgumentParser:
    """The argparse parser that knows every documented flag (help is handled before it runs)."""
    parser = _ArgumentParser(prog=PROG, add_help=False, allow_abbrev=False)
    parser.add_argument(_MODEL_POSITIONAL, nargs="?", default=argparse.SUPPRESS, metavar="MODEL")
    for flag in FLAGS.values():
        common: dict[str, Any] = {"dest": flag.dest, "default": argparse.SUPPRESS}
        if flag.kind is Kind.HELP:
            continue
        if flag.kind is Kind.BOOL:
            action = argparse.BooleanOptionalAction if flag.negatable else "store_true"
            parser.add_argument(*flag.option_strings, action=action, **common)
        elif flag.kind in (Kind.LIST, Kind.INT_LIST):
            parser.add_argument(
                *flag.option_strings,
                nargs="+",
                type=_type(flag, element=True),
                action="extend" if flag.extend else "store",
                metavar=flag.display_metavar(),
                **common,
            )
        else:
            parser.add_argument(*flag.option_strings, type=_type(flag), metavar=flag.display_metavar(), **common)
    return parser


def find_help(argv: Sequence[str]) -> str | None:
    """The help request in `argv`: None (none), "" (plain --help) or the search term."""
    for i, word in enumerate(argv):
        if word == "--":
            return None
        if word == "-h":
            return ""
        if word == "--help":
            following = argv[i + 1] if i + 1 < len(argv) else None
            return following if following is not None and not following.startswith("-") else ""
        if word.startswith("--help="):
            return word.removeprefix("--help=")
    return None


def parse_serve_args(argv: Sequence[str]) -> ServeConfig:
    """Parse `sonar serve` arguments into a `ServeConfig` (see the module docstring)."""
    argv = list(argv)
    term = find_help(argv)
    if term is not None:
        from sonar.cli.help import render_help

        raise HelpRequested(render_help(term))

    words, cli_keys = split_dotted(argv, BY_OPTION)
    namespace, extras = build_parser().parse_known_args(words)
    if extras:
        raise _unrecognized(extras)
    given = vars(namespace)
    positional_model = given.pop(_MODEL_POSITIONAL, None)
    cli_values: dict[str, Any] = {}
    for dest, value in given.items():
        flag = BY_DEST[dest]
        if flag.kind in (Kind.LIST, Kind.INT_LIST):
            try:
                value = convert(flag, value)
            except ValueError as exc:
                raise UsageError.bad(f"argument {flag.name}: {exc}") from None
        cli_values[flag.name] = value
    if positional_model is not None:
        flagged = cli_values.get("--model")
        if flagged is not None and flagged != positional_model:
            raise UsageError.bad(
                f"the model is given twice: {positional_model!r} (positional) and {flagged!r} (--model)"
            )
        cli_values["--model"] = positional_model

    # Layers: defaults < config file (whole values, then dotted keys) < command line (same).
    explicit: dict[str, Any] = {}
    source: dict[str, str] = {}
    config_path = cli_values.get("--config")
    if config_path is not None:
        from sonar.cli.yamlfile import load_config_file

        file_values, file_keys = load_config_file(config_path, BY_DEST)
        explicit.update(file_values)
        _merge_keys(explicit, file_keys)
        source.update({name: f"set in {config_path}" for name in explicit})
    explicit.update(cli_values)
    _merge_keys(explicit, cli_keys)
    source.update({name: "" for name in cli_values})
    source.update({key.flag.name: "" for key in cli_keys})

    _check_support(explicit, source)
    _check_launcher(explicit)
    return _build(explicit)


def _check_launcher(explicit: dict[str, Any]) -> None:
    """torchrun's ranks each run the script that started them: the library's, not a server."""
    if explicit.get("--distributed-executor-backend") == "external_launcher":
        raise UsageError.bad(
            "argument --distributed-executor-backend: 'external_launcher' is for the library under torchrun "
            "(sonar.open in each rank's script); one HTTP server per torchrun rank makes no sense: "
            "serve with 'mp' or 'ray'"
        )


def _merge_keys(values: dict[str, Any], keys: list[DottedKey]) -> None:
    for key in keys:
        name = key.flag.name
        base = values.get(name, key.flag.default)
        merged = copy.deepcopy(base) if isinstance(base, dict) else {}
        merge_key(merged, key.path, key.value)
        values[name] = merged


def _shown(flag: Flag, value: Any) -> str:
    if flag.kind is Kind.BOOL:
        if value is None:
            return "unset"
        return flag.name if value else (f"--no-{flag.name[2:]}" if flag.negatable else "unset")
    if value is None:
        return "unset"
    if isinstance(value, tuple):
        return " ".join(str(v) for v in value) or "[]"
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)


def _check_support(explicit: dict[str, Any], source: dict[str, str]) -> None:
    """Fail on the first value Sonar does not implement, naming the flag (and why, where known)."""
    for name, value in explicit.items():
        flag = FLAGS[name]
        where = source.get(name, "")
        if flag.status is Status.IMPLEMENTED:
            if flag.supported is None or value is None or value in flag.supported:
                continue
            accepted = flag.supported
        else:
            accepted = flag.accepted_values()
            if value in accepted:
                continue
        option = name if flag.kind is not Kind.BOOL else _shown(flag, value)
        details = []
        if flag.kind is not Kind.BOOL:
            details.append(f"got {_shown(flag, value)}")
        shown = [text for text in (_shown(flag, v) for v in accepted) if text != "unset"]
        if shown:
            details.append(f"Sonar accepts only {' or '.join(dict.fromkeys(shown))}")
        if where:
            details.append(where)
        raise UsageError.unsupported(option, "; ".join(details), flag.why)


def _unrecognized(extras: list[str]) -> UsageError:
    word = next((w for w in extras if w.startswith("-")), extras[0])
    if not word.startswith("-"):
        return UsageError.bad(f"unexpected argument {word!r} (the model may be given only once)")
    option = word.split("=", 1)[0]
    known = list(BY_OPTION) + [f"--no-{f.name[2:]}" for f in FLAGS.values() if f.kind is Kind.BOOL and f.negatable]
    close = difflib.get_close_matches(option, known, n=1, cutoff=0.8)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return UsageError.bad(f"unrecognized argument {option}{hint}")


def _value(explicit: dict[str, Any], flag: Flag) -> Any:
    if flag.name in explicit:
        return explicit[flag.name]
    return copy.deepcopy(flag.default)  # never hand out the table's own dicts


def _one_reasoning_parser(serve_args: dict[str, Any], engine_args: dict[str, Any]) -> str:
    """--reasoning-parser(-plugin) and --structured-outputs-config.reasoning_parser(_plugin) are one
    setting, as in vLLM: either sets both (the HTTP frontend splits the thinking off, the engine
    starts a request's grammar after it); given both, they must agree. Returns the option that
    named the parser."""
    structured = engine_args.get("structured_outputs_config") or {}
    if isinstance(structured, str):
        try:
            structured = json.loads(structured)
        except ValueError:
            return "--reasoning-parser"  # the engine config names the bad JSON
    if not isinstance(structured, dict):
        return "--reasoning-parser"
    structured = dict(structured)
    given = (
        "--reasoning-parser" if serve_args.get("reasoning_parser") else "--structured-outputs-config.reasoning_parser"
    )
    for key in ("reasoning_parser", "reasoning_parser_plugin"):
        flag = "--" + key.replace("_", "-")
        ours, theirs = serve_args.get(key) or "", structured.get(key) or ""
        if key.endswith("plugin"):
            ours, theirs = (os.path.abspath(p) if p else "" for p in (ours, theirs))
        if ours and theirs and ours != theirs:
            raise UsageError.bad(
                f"argument {flag}: {ours!r} differs from --structured-outputs-config.{key} {theirs!r} "
                "(they are one setting: give one, or the same in both)"
            )
        serve_args[key] = ours or theirs
        if ours or theirs:
            structured[key] = ours or theirs
    engine_args["structured_outputs_config"] = structured
    return given


def _build(explicit: dict[str, Any]) -> ServeConfig:
    from sonar.engine.config import EngineConfig

    model = explicit.get("--model")
    engine_args: dict[str, Any] = {}
    serve_args: dict[str, Any] = {}
    for flag in FLAGS.values():
        if flag.target is None or "." not in flag.target:
            continue
        part, field = flag.target.split(".", 1)
        value = _value(explicit, flag)
        if part == "engine":
            if value is not None:
                engine_args[field] = value
        else:
            serve_args[field] = value

    mode, fingerprint = serve_args.get("fingerprint_mode"), serve_args.get("fingerprint_value")
    if mode == "custom" and not fingerprint:
        raise UsageError.bad("argument --fingerprint-mode: 'custom' needs --fingerprint-value")
    if engine_args.get("collect_detailed_traces"):
        if not serve_args.get("otlp_traces_endpoint"):
            raise UsageError.bad(
                "argument --collect-detailed-traces: needs --otlp-traces-endpoint (the details are attributes "
                "of the exported request spans, and the per-step spans go there too)"
            )
        engine_args["otlp_traces_endpoint"] = serve_args["otlp_traces_endpoint"]  # the scheduler's step spans
    # tokens held back for the stream may as well be decoded without a trip through the scheduler
    # (the streams' tokens then go out with the step's result, not one by one)
    if serve_args.get("stream_interval", 1) > 1:
        engine_args["decode_steps"] = serve_args["stream_interval"]
        engine_args["stream_steps"] = False
    sample = explicit.get("--kv-cache-metrics-sample")
    if (
        sample is not None
        and sample != FLAGS["--kv-cache-metrics-sample"].default
        and not engine_args.get("kv_cache_metrics")
    ):
        raise UsageError.bad("argument --kv-cache-metrics-sample: takes effect only with --kv-cache-metrics")
    check_parser_flags(serve_args, _one_reasoning_parser(serve_args, engine_args))
    if serve_args.get("enable_ssl_refresh") and not (serve_args.get("ssl_keyfile") and serve_args.get("ssl_certfile")):
        raise UsageError.bad(
            "argument --enable-ssl-refresh: it reloads TLS files, so it needs --ssl-keyfile and --ssl-certfile"
        )
    endpoints = serve_args.pop("disable_access_log_for_endpoints")
    serve_args["disable_access_log_for_endpoints"] = tuple(p.strip() for p in (endpoints or "").split(",") if p.strip())
    names = serve_args.pop("served_model_name")
    if not names:
        from sonar.models.embedded import EMBEDDED_NAME

        names = (model or EMBEDDED_NAME,)

    try:
        engine = EngineConfig.from_args(model, **engine_args)
    except (TypeError, ValueError) as exc:
        raise UsageError.bad(str(exc)) from None
    _check_nodes(explicit, engine, serve_args["headless"])
    _check_api_servers(serve_args, engine)
    return ServeConfig(engine=engine, served_model_name=tuple(names), **serve_args)


def _check_api_servers(serve_args: dict[str, Any], engine: Any) -> None:
    """--api-server-count > 1 runs more API server processes over the one engine
    (`sonar.http.api_servers`); what lives in one API server's memory and cannot be shared
    between them stops the start, naming the flag."""
    count = serve_args.get("api_server_count")
    if count is None or count == 1:
        return
    stays = "lives in the engine's own API server process, so the other API servers would not see it"
    clashes = [
        (serve_args.get("headless"), "--headless", "a headless node runs no API server"),
        (serve_args.get("port") == 0, "--port 0", "each API server would pick another free port"),
        (
            serve_args.get("uds"),
            "--uds",
            "the API servers share a TCP port (SO_REUSEPORT); a Unix socket has no such sharing",
        ),
        (
            engine.data_parallel_size > 1,
            "--data-parallel-size",
            "the data-parallel router (which replica holds which prefix) " + stays,
        ),
        (engine.enable_lora, "--enable-lora", "the LoRA adapter registry (load and unload by name) " + stays),
        (
            engine.enable_sleep_mode,
            "--enable-sleep-mode",
            "sleep and wake-up drain only the requests of the API server asked",
        ),
        (
            engine.weight_transfer_config is not None,
            "--weight-transfer-config",
            "weight updates drain only the requests of the API server asked",
        ),
        (
            serve_args.get("max_stored_responses", 0) > 0,
            "--max-stored-responses",
            "the Responses API's store is kept in each API server's memory, so a response stored by one would be "
            "missing on the others; start with --max-stored-responses 0",
        ),
    ]
    for clash, flag, why in clashes:
        if clash:
            raise UsageError.bad(f"argument --api-server-count: {count} API servers cannot run with {flag}: {why}")


def _check_nodes(explicit: dict[str, Any], engine: Any, headless: bool) -> None:
    """Node 0 (the one with data-parallel replica 0) serves the API; every other node runs
    --headless (`sonar.engine.nodes`); the head's address means something only with several nodes."""
    nnodes, node_rank, start = engine.nnodes, engine.node_rank, engine.data_parallel_start_rank
    if headless and engine.data_parallel_backend == "ray":
        raise UsageError.bad(
            "argument --headless: not supported with --data-parallel-backend ray, where Ray places the replicas "
            "on the cluster's nodes (no headless nodes)"
        )
    if nnodes == 1:
        for name in ("--master-addr", "--master-port"):
            value = explicit.get(name)
            if value is not None and value != FLAGS[name].default:
                raise UsageError.bad(
                    f"argument {name}: takes effect only with --nnodes > 1 (the head's rendezvous), got {value}"
                )
    if start > 0 and not headless:
        raise UsageError.bad(
            f"argument --data-parallel-start-rank: a node whose replicas start at {start} runs no API server "
            "(the head, with replica 0, does): add --headless"
        )
    if headless and nnodes == 1:
        if start == 0:
            raise UsageError.bad(
                "argument --headless: runs the ranks or replicas of a secondary node, so it needs --nnodes > 1 and "
                "--node-rank 1 or more, or --data-parallel-start-rank 1 or more (replica 0 is the head's)"
            )
        return
    if headless and node_rank == 0:
        raise UsageError.bad(
            "argument --headless: node 0 (--node-rank 0) is the head, which serves the API; give the "
            f"headless node its rank, --node-rank 1 .. {nnodes - 1}"
        )
    if node_rank > 0 and not headless:
        raise UsageError.bad(f"argument --node-rank: node {node_rank} runs no API server (node 0 does): add --headless")
