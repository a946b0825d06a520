"""What a served object's public methods are, and how each is run and called.

The vocabulary shared by the serving side (:mod:`rlactors.wire.service`) and the calling side
(:mod:`rlactors.api.handle`): a method is ``async``, ``sync``, ``asyncgen`` or ``gen``, and a plain
method of an actor declared with ``sync_methods="loop"`` runs on the event loop unless marked
:func:`blocking`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = [
    "ASYNC",
    "ASYNCGEN",
    "GEN",
    "SYNC",
    "backpressure",
    "backpressure_of",
    "blocking",
    "method_kind",
    "method_table",
    "runs_on_loop",
]

F = TypeVar("F", bound=Callable[..., Any])

ASYNC, SYNC, ASYNCGEN, GEN = "async", "sync", "asyncgen", "gen"


def method_kind(fn: Callable[..., Any]) -> str:
    """How a method is run and called: async, sync, asyncgen or gen."""
    fn = inspect.unwrap(fn)
    if inspect.isasyncgenfunction(fn):
        return ASYNCGEN
    if inspect.iscoroutinefunction(fn):
        return ASYNC
    if inspect.isgeneratorfunction(fn):
        return GEN
    return SYNC


def method_table(obj: Any) -> dict[str, str]:
    """Public methods of an object (or class) and their kinds."""
    table = {}
    for name in dir(obj):
        if name.startswith("_"):
            continue
        attr = getattr(obj, name, None)
        if callable(attr) and not isinstance(attr, type):
            table[name] = method_kind(attr)
    return table


def blocking(fn: F) -> F:
    """Mark a plain ``def`` method of a ``sync_methods="loop"`` actor as one that may block:
    it runs on the worker thread, in order with the other thread-run methods, not on the loop."""
    fn._rlactors_blocking = True  # type: ignore[attr-defined]
    return fn


def backpressure(why: str) -> Callable[[F], F]:
    """Mark a method whose wait is back-pressure by design (``why``: "under the staleness bound"):
    a caller waiting in it is held back on purpose, so ``cluster.stacks()`` labels the wait so and
    never names its actor the culprit while something else is stuck."""

    def mark(fn: F) -> F:
        fn._rlactors_backpressure = why  # type: ignore[attr-defined]
        return fn

    return mark


def backpressure_of(fn: Callable[..., Any]) -> str:
    """Why a method's wait is back-pressure by design ('' when it is not marked)."""
    return getattr(fn, "_rlactors_backpressure", "")


def runs_on_loop(obj: Any, fn: Callable[..., Any]) -> bool:
    """Whether a plain ``def`` method ``fn`` of ``obj`` runs on the event loop (see :class:`rlactors.Actor`)."""
    return getattr(obj, "_sync_methods", "thread") == "loop" and not getattr(fn, "_rlactors_blocking", False)
