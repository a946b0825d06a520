"""Rewards: GSM8K answer checking, and a runner that keeps reward functions off the event loop.

``gsm8k_reward(completion, item)`` extracts the final answer (the last ``\\boxed{...}``, else
``#### n``) and compares it with the reference: numerically when both are plain numbers
(nearly always for GSM8K, and it cannot hang), else with math_verify.

:class:`RewardRunner` calls any reward function, sync or async, with a timeout; sync ones
run in a worker thread (or a process pool) so a slow checker never stalls the rollout
loop. A timeout or an exception scores 0 and is counted; an exception whose ``drops_group`` is
true (a judge's, nodes/rollout/judge.py) fails the episode instead, so its group is dropped.

:class:`RewardConfig` names the reward function by import path (``[reward]``) and holds its own
settings (``[reward.fn_args]``); shaping the reward
for the advantage estimator is the driver's (nodes/driver/advantage.py, ``[advantage.shaping]``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import logging
import multiprocessing
import re
import threading
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import structlog

from nodes.common.plugins import NoSettings, function_settings, resolve
from nodes.rollout.failures import reward_tally
from protocols.runtime.codec import register
from rlactors.base.aio import wait_for
from rlactors.base.tomlconf import above, check_ranges, import_path

__all__ = [
    "RewardConfig",
    "RewardFn",
    "RewardRunner",
    "extract_answer",
    "final_number_reward",
    "gsm8k_reward",
    "reward_settings",
]

log = structlog.get_logger(__name__)

RewardFn = Callable[[str, Any], "float | Awaitable[float]"]


def reward_settings(path: str) -> type:
    """The settings class of the reward function at import path ``path`` (its ``config_class``)."""
    return function_settings(path, "reward.fn")


@register
@dataclass
class RewardConfig:
    """The reward function, run by the rollout actors on every completion.

    A reward function may declare its settings class (``fn.config_class``, a dataclass): it is
    filled from ``[reward.fn_args]`` and the function is called ``fn(completion, item,
    settings=...)`` (:meth:`function`). One without takes ``fn(completion, item)`` and no table.
    """

    # fn(completion, item) -> float, sync or async
    fn: str = field(default="nodes.rollout.reward:final_number_reward", metadata=import_path())
    timeout_s: float = field(default=10.0, metadata=above(0))  # a call past this scores 0 (and is counted)
    # the function's own settings: an instance of its config_class, from [reward.fn_args]
    fn_args: Any = field(default_factory=NoSettings, metadata={"settings_of": ("fn", reward_settings)})

    def __post_init__(self) -> None:
        check_ranges(self)

    def function(self) -> RewardFn:
        """The reward function ``fn`` names, with its settings bound when it declares any."""
        fn = resolve(self.fn, "reward.fn")
        if isinstance(self.fn_args, NoSettings):
            return fn
        return functools.partial(fn, settings=self.fn_args)


_HASHES = re.compile(r"####\s*([^\n]+)")
_NUMBER = re.compile(r"^[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?$")
_ANY_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")


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
    if len(pred) > MAX_SYMBOLIC_CHARS:  # no GSM8K answer is this long; sympy could chew on it forever
        return 0.0
    try:
        return float(_SYMBOLIC(ref, pred, SYMBOLIC_TIMEOUT_S))
    except RuntimeError as e:  # no checker: this answer cannot be verified, so it does not score
        log.error("reward.symbolic_unavailable", error=str(e))
        return 0.0


def final_number_reward(completion: str, item: Mapping[str, Any]) -> float:
    """As :func:`gsm8k_reward`, but a completion without ``\\boxed{}`` or ``####`` is read by its
    last number: how graders score small models, which rarely follow the answer format."""
    if extract_answer(completion) is not None:
        return gsm8k_reward(completion, item)
    numbers = _ANY_NUMBER.findall(completion)
    return gsm8k_reward(f"#### {numbers[-1]}", item) if numbers else 0.0


MAX_SYMBOLIC_CHARS = 200
SYMBOLIC_TIMEOUT_S = 5.0


def _symbolic_worker(conn: Any) -> None:
    """The child process: answer ``(ref, pred)`` pairs with math_verify until the pipe closes."""
    from math_verify import parse, verify

    # math_verify's own timeouts are signal based; this process is killed from outside instead
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    try:
        conn.send("ready")
        while True:
            ref, pred = conn.recv()
            try:
                gold = parse(f"${ref}$", parsing_timeout=None)
                guess = parse(f"${pred}$", parsing_timeout=None)
                ok = bool(gold) and bool(guess) and bool(verify(gold, guess, timeout_seconds=None))
            except Exception:  # math_verify raises many types on odd input: no match
                ok = False
            conn.send(ok)
    except (EOFError, OSError):  # the parent went away (its process ended): nothing to answer
        return


class _SymbolicChecker:
    """math_verify in a child process that is killed when a check overruns: sympy can run for ever
    on some inputs (``9^{9^{9^9}}``) and a thread cannot be stopped. One check at a time (symbolic
    answers are rare in GSM8K); the process starts on first use and again after a kill."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: Any = None
        self._conn: Any = None

    def __call__(self, ref: str, pred: str, timeout_s: float) -> bool:
        # waiting for another check counts against this one's time: a few runaway answers must
        # not queue every later check behind them
        if not self._lock.acquire(timeout=timeout_s):
            log.warning("reward.symbolic_busy", timeout_s=timeout_s, answer=pred[:80])
            return False
        try:
            if self._proc is None or not self._proc.is_alive():
                self._start()
            self._conn.send((ref, pred))
            if self._conn.poll(timeout_s):
                return bool(self._conn.recv())
            self._stop()
            log.warning("reward.symbolic_timeout", timeout_s=timeout_s, answer=pred[:80])
            return False
        except (EOFError, OSError) as e:  # the child died: the next call starts a new one
            if self._proc is not None:
                self._stop()
            log.warning("reward.symbolic_worker_lost", error=repr(e))
            return False
        finally:
            self._lock.release()

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_symbolic_worker, args=(child,), daemon=True, name="math-verify")
        self._proc.start()
        child.close()
        try:
            ready = self._conn.poll(120) and self._conn.recv() == "ready"  # the import takes seconds
        except EOFError:  # it exited: e.g. a script without `if __name__ == "__main__":` re-ran
            ready = False
        if not ready:
            self._stop()
            raise RuntimeError(
                "the math_verify worker process did not start (a script that uses gsm8k_reward must "
                'keep its top-level work under `if __name__ == "__main__":`)'
            )

    def _stop(self) -> None:
        self._proc.kill()
        self._proc.join(5)
        self._conn.close()
        self._proc = self._conn = None


_SYMBOLIC = _SymbolicChecker()


class RewardRunner:
    """Run a reward function with a timeout, off the event loop; failures score 0 and are counted,
    the first of each kind logged with its stack. Each call also counts in the episode's
    :class:`~nodes.rollout.failures.RewardTally`, where a rollout actor set one: an episode whose
    every reward call failed is a failed episode (nodes/rollout/failures.py)."""

    def __init__(
        self,
        fn: RewardFn,
        timeout_s: float = RewardConfig.timeout_s,
        executor: Literal["thread", "process"] = "thread",
        max_workers: int = 4,
        name: str = "",
    ) -> None:
        self.fn = fn
        self.name = name or getattr(fn, "__qualname__", type(fn).__name__)
        self._logged: set[str] = set()  # the kinds of failure logged (each once)
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
        tally = reward_tally.get()
        if tally is not None:
            tally.calls += 1
            tally.name = self.name
        try:
            if self._is_async:
                # _is_async: fn returns an awaitable
                value = await wait_for(cast(Awaitable[float], self.fn(completion, item)), self.timeout_s)
            else:
                loop = asyncio.get_running_loop()
                sync_fn = cast(Callable[[str, Any], float], self.fn)
                value = await wait_for(
                    loop.run_in_executor(self._pool, sync_fn, completion, item), self.timeout_s
                )
            return float(value)
        except TimeoutError:
            self.counters["timeouts"] += 1
            # not a failure of the function: a loaded machine times out a correct one
            self._failed(TimeoutError(f"took longer than reward.timeout_s = {self.timeout_s:g} s"), None)
            return 0.0
        except Exception as e:  # a broken checker must not kill the episode
            if getattr(e, "drops_group", False):  # the function asks for its group to be dropped (a judge)
                raise
            self.counters["errors"] += 1
            self._failed(e, tally)
            return 0.0

    def _failed(self, e: BaseException, tally: Any) -> None:
        if tally is not None:
            tally.failed(e)
        if (kind := type(e).__name__) not in self._logged:  # later ones are counted (counters)
            self._logged.add(kind)
            log.warning(
                "reward.error",
                fn=self.name,
                error=f"{kind}: {e}",
                exc_info=e,
                note="logged once per kind; later ones are counted",
            )

    def close(self) -> None:
        """Stop the worker pool (threads finish their current call; processes are not waited for)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
