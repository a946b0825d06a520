"""structlog set-up for runtime processes: one line per event, with node/actor context bound;
and :class:`Throttle`, which keeps a flood of one warning (bad messages from a peer) to a few lines."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
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


def ensure_logging() -> None:
    """Give structlog a sane default (INFO, one line per event) unless the application configured it."""
    if not structlog.is_configured():
        configure()


class Throttle:
    """Log one repeated warning at most once per ``interval`` seconds.

    The first occurrence is logged at once; the others within the interval are counted and
    reported in one line when it ends (``repeats=N``, with the fields of the last one). Use
    from one event loop.
    """

    def __init__(self, logger: Any, event: str, interval: float = 10.0) -> None:
        self._log = logger
        self.event = event
        self.interval = interval
        self._quiet_until = 0.0
        self._repeats = 0
        self._last: dict[str, Any] = {}
        self._timer: asyncio.TimerHandle | None = None

    def __call__(self, **fields: Any) -> None:
        now = time.monotonic()
        if now >= self._quiet_until and self._timer is None:
            repeats, self._repeats = self._repeats, 0
            self._quiet_until = now + self.interval
            self._log.warning(self.event, **fields, **({"repeats": repeats} if repeats else {}))
            return
        self._repeats += 1
        self._last = fields
        if self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop: the count goes out with the next line
                return
            self._timer = loop.call_later(max(0.0, self._quiet_until - now), self._flush)

    def flush(self) -> None:
        """Write the count held back now (e.g. before the process ends), not when the interval ends."""
        if self._timer is not None:
            self._timer.cancel()
        self._flush()

    def _flush(self) -> None:
        self._timer = None
        if self._repeats:
            self._log.warning(
                self.event, **self._last, repeats=self._repeats, within_s=round(self.interval, 1)
            )
            self._repeats = 0
            self._quiet_until = time.monotonic() + self.interval
