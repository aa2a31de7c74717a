"""Structured logging for every Sonar process (structlog, one line per event on stderr).

With a logging configuration file (`--log-config-file`, passed on to child processes as
`SONAR_LOG_CONFIG_FILE`), events go instead through the standard library's loggers, named as
Sonar names them (``sonar.http``, ``sonar.scheduler``, ...), so the file's dictConfig decides
their handlers, levels and formats; each record's message is the event and its fields.
"""

from __future__ import annotations

import json
import logging
import logging.config
import os
import sys
from typing import Any

import structlog

from sonar.errors import SonarError

CONFIG_FILE_ENV = "SONAR_LOG_CONFIG_FILE"

_configured = False


class LogConfigError(SonarError):
    """The logging configuration file cannot be read or applied."""


def configure(level: str | None = None) -> None:
    """Configure structlog once per process; `SONAR_LOG_LEVEL` (default info) sets the level, and
    `SONAR_LOG_CONFIG_FILE` (when set) routes events through the standard library instead."""
    global _configured
    if _configured:
        return
    _configured = True
    path = os.environ.get(CONFIG_FILE_ENV)
    if path:
        _through_stdlib(read_config_file(path))
        return
    name = (level or os.environ.get("SONAR_LOG_LEVEL") or "info").upper()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S.%f", utc=False),
            structlog.processors.format_exc_info,
            structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, name, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def read_config_file(path: str) -> dict[str, Any]:
    """The dictConfig in the JSON file at `path`, checked by applying it to the standard library's
    logging (so a bad file fails here, naming itself)."""
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except OSError as exc:
        raise LogConfigError(f"--log-config-file {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise LogConfigError(f"--log-config-file {path}: invalid JSON: {exc.msg} at line {exc.lineno}") from None
    if not isinstance(config, dict):
        raise LogConfigError(f"--log-config-file {path}: expected a JSON object (a logging dictConfig)")
    config.setdefault("version", 1)
    try:
        logging.config.dictConfig(config)
    except (ValueError, TypeError, AttributeError, ImportError) as exc:
        raise LogConfigError(f"--log-config-file {path}: {exc}") from None
    return config


def use_config_file(path: str) -> dict[str, Any]:
    """Apply the logging configuration file at `path` to this process (its loggers, created or
    not) and to the child processes it starts; the dictConfig, for uvicorn to apply as well."""
    global _configured
    config = read_config_file(path)
    os.environ[CONFIG_FILE_ENV] = os.path.abspath(path)
    _configured = True
    _through_stdlib(config)
    return config


def _through_stdlib(config: dict[str, Any]) -> None:
    # The levels are the configuration's (filter_by_level), the time and level its formatters'.
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            structlog.contextvars.merge_contextvars,
            structlog.processors.format_exc_info,
            structlog.dev.ConsoleRenderer(
                colors=False, pad_event_to=0, exception_formatter=structlog.dev.plain_traceback
            ),
        ],
        wrapper_class=structlog.stdlib.BoundLogger,
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=True,
    )


def get_logger(name: str):
    configure()
    return structlog.get_logger(name)
