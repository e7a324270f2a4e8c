"""Structured logging (structlog) to stderr, as JSON lines or for a console."""

from __future__ import annotations

import logging
import sys

import structlog


#: The (level, format) of the last configure_logging, for processes this one spawns.
_current = ("INFO", "console")


def current_logging() -> tuple[str, str]:
    """Arguments that give a spawned process this process's logging (a spawned Python
    starts with structlog's default, which prints to stdout: into a --json answer)."""
    return _current


def configure_logging(level: str = "INFO", fmt: str = "console") -> None:
    global _current
    _current = (level, fmt)
    renderer = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    logging.basicConfig(level=level.upper(), stream=sys.stderr, format="%(message)s")
    # Client libraries log every request at INFO; their failures still show as warnings.
    for noisy in ("httpx", "httpx2", "httpcore"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLevelName(level.upper())))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)
