"""structlog set-up for runtime processes: one line per event, with node/actor context bound."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

_configured = False


def configure(level: str | None = None, **context: Any) -> None:
    """Configure structlog once per process and bind ``context`` (e.g. node, actor) to every line.

    Level comes from ``level`` or ``RLACTORS_LOG_LEVEL`` (default INFO). Library users who
    configure structlog themselves can skip this: the runtime only calls it in its own
    processes (workers, agents, the head started by the CLI).
    """
    global _configured
    name = (level or os.environ.get("RLACTORS_LOG_LEVEL", "INFO")).upper()
    lvl = getattr(logging, name, logging.INFO)
    if not _configured:
        structlog.configure(
            processors=[
                structlog.contextvars.merge_contextvars,
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False),
                structlog.processors.format_exc_info,
                structlog.dev.ConsoleRenderer(colors=False),
            ],
            wrapper_class=structlog.make_filtering_bound_logger(lvl),
            logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
            cache_logger_on_first_use=True,
        )
        _configured = True
    if context:
        structlog.contextvars.bind_contextvars(**{k: v for k, v in context.items() if v is not None})
