"""Failures that repeat stop the run; occasional ones are dropped, counted and logged once per kind.

A rollout actor records every episode's outcome in a :class:`FailureWatch`: an episode fails when
its workflow (an environment, an agent, a rubric) raises, or when its reward function raised on
every sample. The watch says the run must stop when

- every one of the first ``first`` episodes failed (the first batch: nothing to train on will
  ever come), or
- at least ``max_share`` of the last ``window`` episodes failed,

and then :meth:`FailureWatch.line` is the one line the run ends with: what failed (the function
or environment by name), the exception's type and message, how many failed of how many, and the
first failing item's id. The rollout actor hands it to the buffer, whose ``get_batch`` raises
:class:`~nodes.plane.buffer.RepeatedFailureError` with it; the recipe prints it and exits 2.
The first failure of each kind is logged with its stack; later ones only count.

Ray, Slurm and PyTorch's elastic agent draw the same line: a fault that will repeat is reported
once and ends the job; a transient one is retried or dropped and counted.
"""

from __future__ import annotations

import contextvars
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import structlog

__all__ = ["MIN_FIRST", "FailureWatch", "RewardTally", "reward_tally"]

log = structlog.get_logger(__name__)

# Episodes judged by the first-batch rule at least: with a small batch, two unlucky failures in a row
# of an environment that fails now and then must not stop the run
MIN_FIRST = 8


@dataclass
class RewardTally:
    """One episode's reward calls: how many, how many raised, and the first exception."""

    calls: int = 0
    errors: int = 0
    first: BaseException | None = None
    name: str = ""  # the reward function's, as the runner knows it

    def failed(self, e: BaseException) -> None:
        self.errors += 1
        if self.first is None:
            self.first = e


# The episode whose reward calls a RewardRunner is making (set by the rollout actor per episode;
# tasks the episode starts inherit it)
reward_tally: contextvars.ContextVar[RewardTally | None] = contextvars.ContextVar(
    "reward_tally", default=None
)


def _item_id(item: Any, fallback: str) -> str:
    if isinstance(item, dict) and item.get("id") is not None:
        return str(item["id"])
    return fallback


def _exc_text(e: BaseException) -> str:
    text = " ".join(str(e).split())  # one line
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


@dataclass
class FailureWatch:
    """Outcomes of one rollout actor's episodes, and whether they say the run must stop."""

    first: int = 1  # episodes that make this actor's share of the first batch
    window: int = 64  # the last this many episodes are judged by max_share
    max_share: float = 0.9  # this share of the window failing stops the run
    _recent: deque[bool] = field(default_factory=deque)  # True: failed
    _seen_kinds: set[str] = field(default_factory=set)
    n: int = 0
    failed: int = 0
    _first_failure: tuple[str, BaseException, str] | None = None  # (what, exception, item id)
    _all_failed_so_far: bool = True

    def ok(self) -> str | None:
        """An episode succeeded; None (a success never stops the run)."""
        self._record(False)
        return None

    def failure(self, what: str, e: BaseException, item: Any, group_id: str) -> str | None:
        """An episode failed (``what`` raised ``e`` on ``item``). The first failure of each kind (what
        failed, and the exception's type) is logged with its stack; later ones are only counted.
        Returns the line to stop the run with, or None."""
        kind = f"{what}: {type(e).__name__}"
        if kind not in self._seen_kinds:
            self._seen_kinds.add(kind)
            stack = "".join(traceback.format_exception(type(e), e, e.__traceback__))
            log.warning(
                "rollout.episode_failed",
                what=what,
                error=_exc_text(e),
                item=_item_id(item, group_id),
                stack=stack,
                note="logged once per kind; later ones are counted",
            )
        if self._first_failure is None:
            self._first_failure = (what, e, _item_id(item, group_id))
        self._record(True)
        return self.verdict()

    def _record(self, failed: bool) -> None:
        self.n += 1
        self.failed += failed
        self._all_failed_so_far = self._all_failed_so_far and failed
        self._recent.append(failed)
        if len(self._recent) > self.window:
            self._recent.popleft()

    def verdict(self) -> str | None:
        """The line to stop the run with, when the failures so far say it must stop; else None."""
        if self._first_failure is None:
            return None
        if self._all_failed_so_far and self.n >= self.first:
            return self.line(self.n, self.n, "every episode so far, the first batch's included")
        share = sum(self._recent) / len(self._recent)
        if len(self._recent) >= self.window and share >= self.max_share:
            return self.line(
                sum(self._recent),
                len(self._recent),
                f"rollout.max_failure_share = {self.max_share:g} of the last {self.window}",
            )
        return None

    def line(self, failed: int, of: int, why: str) -> str:
        """The one line the run stops with."""
        assert self._first_failure is not None
        what, e, item = self._first_failure
        return (
            f"{what} failed on {failed} of {of} episodes ({why}): {_exc_text(e)}; first failing item: "
            f"{item}. Fix it and run again (the first failure's stack is in the rollout actor's log)"
        )
