"""Structured logging for every Sonar process (structlog, one line per event on stderr)."""

from __future__ import annotations

import logging
import os
import sys

import structlog

_configured = False


def configure(level: str | None = None) -> None:
    """Configure structlog once per process; `SONAR_LOG_LEVEL` (default info) sets the level."""
    global _configured
    if _configured:
        return
    _configured = True
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


def get_logger(name: str):
    configure()
    return structlog.get_logger(name)
