"""Structured logging (structlog) to stderr, as JSON lines or for a console."""

from __future__ import annotations

import logging
import sys

import structlog


#: The settings ``log_level`` and ``log_format`` (kvstream.settings): their values, and
#: what they are when no flag, variable or TOML key sets them.
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
FORMATS = ("console", "json")
DEFAULT_LEVEL = "INFO"
DEFAULT_FORMAT = "console"

#: The (level, format) of the last configure_logging, for processes this one spawns.
_current = (DEFAULT_LEVEL, DEFAULT_FORMAT)


def current_logging() -> tuple[str, str]:
    """Arguments that give a spawned process this process's logging (a spawned Python
    starts with structlog's default, which prints to stdout: into a --json answer)."""
    return _current


def configure_logging(level: str = DEFAULT_LEVEL, fmt: str = DEFAULT_FORMAT) -> None:
    global _current
    _current = (level, fmt)
    renderer = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    logging.basicConfig(level=level.upper(), stream=sys.stderr, format="%(message)s")
    # Again when a command has read the settings: basicConfig then leaves the root as it was.
    logging.getLogger().setLevel(level.upper())
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


def logging_flags() -> dict[str, str | None]:
    """The ``kvstream`` group's --log-level / --log-format (or KVSTREAM_LOG_LEVEL /
    KVSTREAM_LOG_FORMAT) of the command running now, None where not given: a command
    that loads the settings passes them as flags, so that they win over the TOML file."""
    import click

    ctx = click.get_current_context(silent=True)
    params = ctx.find_root().params if ctx is not None else {}
    return {"log_level": params.get("log_level"), "log_format": params.get("log_format")}


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)
