"""`python -m sonar serve`: parse the flags, then (until the HTTP server exists) say what would run."""

from __future__ import annotations

import sys
from typing import Sequence

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
    for line in describe(config):
        print(f"{PROG}: {line}")
    print(f"{PROG}: the HTTP server is not built yet; nothing is started")
    return 0


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
