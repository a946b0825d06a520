"""Where a run is: the last completed step, the policy version, what it has trained, and its
checkpoints; and how a run stops when the scheduler says so.

:class:`RunState` owns the step and data-position bookkeeping a loop would otherwise carry in
loose variables: it loads a checkpoint on resume, records each trained batch, and saves
``<out>/checkpoints/step-N`` (weights, optimizer, RNG and the data position) with the ``latest``
pointer. The policy version is the trainer's: :meth:`RunState.record` takes it from the step's
result.

:class:`Termination` turns SIGTERM (how Slurm and Kubernetes stop a job, with a grace period)
into an orderly stop: a wait for a batch ends at once, a step already training finishes, the
last completed step is checkpointed if it is not on disk yet, all within ``grace_s``; past that the
run is cancelled as Ctrl-C would.
"""

from __future__ import annotations

import asyncio
import fcntl
import signal
import uuid
from collections.abc import Awaitable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from nodes.rollout.prompts import trained_position
from nodes.trainer.manifest import resume_point, saved_here, write_latest

__all__ = ["RunLockedError", "RunState", "Terminated", "Termination"]


class RunLockedError(RuntimeError):
    """Another live run writes to the same output folder."""


T = TypeVar("T")


class RunState:
    """Step, version and data position of a run whose checkpoints live in ``<out>/checkpoints``."""

    def __init__(self, out: Path, resume: bool = False, n_items: int = 0) -> None:
        """With ``resume``, the run continues from the last checkpoint in ``<out>/checkpoints``
        (``resume_from``; CheckpointError now if none is usable). ``n_items``: prompts per epoch.
        The folder is this run's alone while it lives (``<out>/.lock``): a second run given the
        same ``run.out_dir`` is refused (RunLockedError) instead of writing over the first."""
        self.out, self.n_items = out, n_items
        out.mkdir(parents=True, exist_ok=True)
        self._lock = (out / ".lock").open("a")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise RunLockedError(
                f"another run is using {out} (it holds {out / '.lock'}): give this one its own run.out_dir"
            ) from None
        self.checkpoints = out / "checkpoints"
        self.resume_from = resume_point(self.checkpoints)[0] if resume else None
        self.step = 0  # steps completed
        self.version = 0  # the policy version the trainer's weights are at
        self.saved_step: int | None = None  # the step of the newest checkpoint on disk
        self.done_epochs = 0
        self.trained: set[str] = set()  # group ids trained in epochs not yet done

    async def load(self, ranks: Any) -> str:
        """Load checkpoint ``resume_from`` into every rank; a line saying where the run continues."""
        assert self.resume_from is not None
        step = self.resume_from
        state = (await ranks.load(str(self.checkpoints / f"step-{step}")))[0]
        data = (state.get("data_position") or {}).get("data") or {"done_epochs": 0, "trained": []}
        self.step, self.saved_step, self.version = step, step, int(state["version"])
        self.done_epochs, self.trained = int(data["done_epochs"]), set(data["trained"])
        return (
            f"resumed from step {step} (policy version {self.version}; data: {self.done_epochs} epochs "
            f"done, {len(self.trained)} prompts of the next trained)"
        )

    def record(self, batch: Any, stats: dict[str, Any], seen: Iterable[str] = ()) -> None:
        """A step trained ``batch``; ``stats`` is the trainer's result (its ``version`` is the new one).
        ``seen``: groups dropped untrained (the buffer's ``take_dropped``), done for their epoch too."""
        self.step += 1
        self.version = int(stats["version"])
        self.trained.update(g.group_id for g in batch.groups)
        self.trained.update(seen)

    def checkpoint_due(self, every: int, last_step: int) -> bool:
        """Whether this step saves: every ``every`` steps (0: never) and at ``last_step``."""
        return self.step == last_step or bool(every and self.step % every == 0)

    async def save(self, ranks: Any) -> Path:
        """Checkpoint the completed step on every rank and point ``latest`` at it, once this process
        sees the checkpoint there too (CheckpointError otherwise; ``latest`` is left as it was)."""
        data = trained_position(self.trained, self.n_items, self.done_epochs)
        self.done_epochs, self.trained = data["done_epochs"], set(data["trained"])  # whole epochs: a number
        path = self.checkpoints / f"step-{self.step}"
        save_id = uuid.uuid4().hex
        position = {"step": self.step, "version": self.version, "data": data, "save_id": save_id}
        await ranks.save(str(path), position)
        saved_here(path, save_id)
        write_latest(self.checkpoints, self.step)
        self.saved_step = self.step
        return path


class Terminated(Exception):
    """SIGTERM arrived: the loop stopped at a step boundary."""


class Termination:
    """SIGTERM handling for the running task: :meth:`wait` races a wait against the signal, and
    ``grace_s`` after the signal the task is cancelled whatever it is doing."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.requested = asyncio.Event()
        self._task = asyncio.current_task()
        self._hard_stop: asyncio.TimerHandle | None = None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self) -> None:
        if self.requested.is_set():
            return
        self.requested.set()
        if self._task is not None:
            self._hard_stop = asyncio.get_running_loop().call_later(self.grace_s, self._task.cancel)

    async def wait(self, aw: Awaitable[T]) -> T:
        """``await aw``, unless SIGTERM comes first: then ``aw`` is cancelled and Terminated raised."""
        work = asyncio.ensure_future(aw)
        stop = asyncio.ensure_future(self.requested.wait())
        try:
            await asyncio.wait([work, stop], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
        if work.cancelled() and self.requested.is_set():
            raise Terminated
        return work.result()

    def check(self) -> None:
        """Raise Terminated if SIGTERM has arrived (call at a step boundary)."""
        if self.requested.is_set():
            raise Terminated

    def close(self) -> None:
        if self._hard_stop is not None:
            self._hard_stop.cancel()
        asyncio.get_running_loop().remove_signal_handler(signal.SIGTERM)
