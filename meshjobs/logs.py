"""Logging: structlog, JSON lines when not on a terminal, readable lines on one.

Every line a member writes has one format, whoever logs it: structlog's own loggers (meshd's
code) and the standard library's `logging` (pysyncobj, asyncio, aiohttp) go through the same
processors and the same renderer. The stdlib's lines reach them by structlog's stdlib
integration: a `ProcessorFormatter` on the root logger's handler, which gives a foreign record
the same keys (`event`, `level`, `timestamp`, and `logger`: the stdlib logger's name).
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

# The processors every line goes through, before the renderer.
SHARED_PROCESSORS: tuple = (
    structlog.contextvars.merge_contextvars,
    structlog.processors.add_log_level,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
)


def renderer_for(stream) -> structlog.typing.Processor:
    """JSON lines when the stream is not a terminal, readable lines on one."""
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        return structlog.dev.ConsoleRenderer()
    return structlog.processors.JSONRenderer()


def stdlib_formatter(renderer: structlog.typing.Processor) -> logging.Formatter:
    """A stdlib formatter rendering foreign records as structlog renders its own lines."""
    return structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*SHARED_PROCESSORS, structlog.stdlib.add_logger_name],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, renderer],
    )


class BindFailedWithoutTraceback(logging.Filter):
    """pysyncobj logs a Raft port it cannot bind as "failed to perform initialization" with a
    whole traceback; meshd says which address and what to do itself (the `listen_failed` line
    and stderr, meshjobs/ports.py). The line stays, with the cause as one line of text."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == "failed to perform initialization" and record.exc_info:
            exc = record.exc_info[1]
            cause = exc.__cause__ or exc.__context__ if exc is not None else None
            record.msg = "failed to perform initialization: %s"
            record.args = (repr(cause if cause is not None else exc),)
            record.exc_info = None
            record.exc_text = None
        return True


def configure(level: str | None = None, stream=None) -> None:
    """Set up structlog (and the stdlib logging pysyncobj uses) once per process."""
    stream = stream or sys.stderr
    name = (level or os.environ.get("MESHJOBS_LOG_LEVEL") or "info").upper()
    lvl = getattr(logging, name, logging.INFO)
    renderer = renderer_for(stream)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(stdlib_formatter(renderer))
    handler.addFilter(BindFailedWithoutTraceback())
    # pysyncobj and asyncio are chatty at info: their lines start at warning.
    logging.basicConfig(level=max(lvl, logging.WARNING), handlers=[handler])
    structlog.configure(
        processors=[*SHARED_PROCESSORS, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=True,
    )
