"""Logging: structlog, JSON lines when not on a terminal, readable lines on one."""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure(level: str | None = None, stream=None) -> None:
    """Set up structlog (and the stdlib logging pysyncobj uses) once per process."""
    stream = stream or sys.stderr
    name = (level or os.environ.get("MESHJOBS_LOG_LEVEL") or "info").upper()
    lvl = getattr(logging, name, logging.INFO)
    logging.basicConfig(level=max(lvl, logging.WARNING), stream=stream, format="%(name)s %(levelname)s %(message)s")
    renderer = (structlog.dev.ConsoleRenderer() if stream.isatty()
                else structlog.processors.JSONRenderer())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=True,
    )
