"""Rewards: GSM8K answer checking, and a runner that keeps reward functions off the event loop.

``gsm8k_reward(completion, item)`` extracts the final answer (the last ``\\boxed{...}``, else
``#### n``) and compares it with the reference: numerically when both are plain numbers
(nearly always for GSM8K, and it cannot hang), else with math_verify.

:class:`RewardRunner` calls any reward function, sync or async, with a timeout; sync ones
run in a worker thread (or a process pool) so a slow checker never stalls the rollout
loop. A timeout or an exception scores 0 and is counted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import multiprocessing
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal

import structlog

__all__ = ["RewardFn", "RewardRunner", "extract_answer", "gsm8k_reward"]

log = structlog.get_logger(__name__)

RewardFn = Callable[[str, Any], "float | Awaitable[float]"]

_HASHES = re.compile(r"####\s*([^\n]+)")
_NUMBER = re.compile(r"^[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?$")


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, j = 1, i
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return text[i : j - 1] if depth == 0 else None


def extract_answer(text: str) -> str | None:
    """The final answer in a completion or reference: last ``\\boxed{}``, else after ``####``."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    hashes = _HASHES.findall(text)
    return hashes[-1].strip() if hashes else None


def _as_number(s: str) -> float | None:
    s = s.strip().strip("$").strip()
    s = re.sub(r"\\text\{[^}]*\}|\\[,!;: ]|\\%|%|\\\$", "", s).replace(",", "").strip().rstrip(".")
    return float(s) if _NUMBER.match(s) else None


def gsm8k_reward(completion: str, item: Mapping[str, Any]) -> float:
    """1.0 if the completion's final answer equals ``item["answer"]`` (GSM8K style), else 0.0."""
    ref_text = str(item["answer"])
    ref = extract_answer(ref_text) or ref_text.strip()
    pred = extract_answer(completion)
    if pred is None:
        return 0.0
    a, b = _as_number(pred), _as_number(ref)
    if a is not None and b is not None:
        return float(abs(a - b) <= 1e-6 * max(1.0, abs(b)))
    from math_verify import parse, verify  # slow import, only for non-numeric answers

    # Our RewardRunner enforces the timeout; math_verify's own (signal based) cannot run off the
    # main thread, and it warns about that on every call.
    logging.getLogger("math_verify").setLevel(logging.ERROR)

    # Signal-based timeouts only work on the main thread; the runner bounds the time instead.
    gold = parse(f"${ref}$", parsing_timeout=None)  # type: ignore[arg-type]
    guess = parse(f"${pred}$", parsing_timeout=None)  # type: ignore[arg-type]
    return float(bool(gold) and bool(guess) and verify(gold, guess, timeout_seconds=None))


class RewardRunner:
    """Run a reward function with a timeout, off the event loop; failures score 0 and are counted."""

    def __init__(
        self,
        fn: RewardFn,
        timeout_s: float = 10.0,
        executor: Literal["thread", "process"] = "thread",
        max_workers: int = 4,
    ) -> None:
        self.fn = fn
        self.timeout_s = timeout_s
        self._is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None)  # noqa: B004 - async callable objects
        )
        self._pool: concurrent.futures.Executor | None = None
        if executor == "process" and not self._is_async:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                max_workers, mp_context=multiprocessing.get_context("spawn")
            )
        elif not self._is_async:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="reward")
        self.counters = {"calls": 0, "timeouts": 0, "errors": 0}

    async def __call__(self, completion: str, item: Any) -> float:
        """The reward, or 0.0 on timeout or error."""
        self.counters["calls"] += 1
        try:
            if self._is_async:
                value = await asyncio.wait_for(self.fn(completion, item), self.timeout_s)  # type: ignore[arg-type]
            else:
                loop = asyncio.get_running_loop()
                fut = loop.run_in_executor(self._pool, self.fn, completion, item)
                value = await asyncio.wait_for(fut, self.timeout_s)
            return float(value)  # type: ignore[arg-type]
        except TimeoutError:
            self.counters["timeouts"] += 1
            log.warning("reward.timeout", timeout_s=self.timeout_s)
            return 0.0
        except Exception as e:  # a broken checker must not kill the episode
            self.counters["errors"] += 1
            log.warning("reward.error", error=f"{type(e).__name__}: {e}")
            return 0.0

    def close(self) -> None:
        """Stop the worker pool (threads finish their current call; processes are not waited for)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
