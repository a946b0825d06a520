"""Staleness governor: meters episode admission so training data is at most eta versions old.

With trainer version v, batch size B (groups per training step), max staleness eta and a
concurrency limit C, at most

    capacity = min(C - running, (eta + v + 1) * B - (accepted + running))

new episodes may start. ``running`` counts episodes admitted and not yet finished;
``accepted`` counts finished episodes that were (or will be) handed to the trainer.

Why this bounds staleness (AReaL's argument): an episode admitted at version a is, at
that moment, one of at most (eta + a + 1) * B episodes that are accepted or running. If
the trainer consumes in admission-version order, B per version, that episode is in a
batch no later than version eta + a, and all its tokens were generated at versions >= a.
Consumption in *completion* order breaks the argument (a straggler can be overtaken by
many newer episodes), which is why the trajectory buffer orders by admission version and
drops, counted, anything older than the bound as a safety net (see nodes/plane/buffer.py).

Admissions are leases of the asking holder (a rollout actor): when it dies, its leases are
released so capacity does not leak. :class:`StalenessGovernor` is plain logic (it only
uses an asyncio.Event to let callers wait without polling); :class:`GovernorActor` serves
it as an rlactors actor and turns runtime death notices into ``holder_died``.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import structlog

import rlactors
from protocols.runtime.codec import register
from rlactors.base.aio import wait_for
from rlactors.base.tomlconf import at_least, check_ranges

__all__ = ["GovernorActor", "GovernorConfig", "Grant", "StalenessGovernor"]

log = structlog.get_logger(__name__)


@register
@dataclass
class GovernorConfig:
    """Admission limits (the recipe's ``[async]`` table)."""

    batch_size: int = field(default=4, metadata=at_least(1))  # groups (episodes) per training step
    # eta: no trained token older than this many versions; 0 = synchronous
    max_staleness: int = field(default=2, metadata=at_least(0))
    # episodes running at once, all rollout actors together
    max_concurrent: int = field(default=32, metadata=at_least(1))

    def __post_init__(self) -> None:
        check_ranges(self)


@register
@dataclass
class Grant:
    """``n`` admissions granted at policy ``version``; episodes must stamp tokens with >= version."""

    n: int
    version: int


@dataclass
class _Stats:
    acquires: int = 0
    granted: int = 0
    waits: int = 0
    wait_timeouts: int = 0
    finished_accepted: int = 0
    finished_rejected: int = 0
    released_by_death: int = 0
    holder_deaths: int = 0
    discarded: int = 0
    over_finish: int = 0
    recoveries: int = 0


class StalenessGovernor:
    """The admission ledger: capacity formula, per-holder leases, and waiting for capacity."""

    def __init__(self, config: GovernorConfig, version: int = 0) -> None:
        self.config = config
        self.version = version
        self.running = 0
        self.max_concurrent = config.max_concurrent  # follows the live servers (set_servers)
        self.accepted = version * config.batch_size
        self._leases: Counter[str] = Counter()
        self._dead: set[str] = set()
        self._stats = _Stats()
        self._changed = asyncio.Event()  # set and replaced whenever capacity may have grown

    # -- the formula ---------------------------------------------------------------

    def capacity(self) -> int:
        """How many new episodes may start now (never negative)."""
        c = self.config
        by_concurrency = self.max_concurrent - self.running
        by_staleness = (c.max_staleness + self.version + 1) * c.batch_size - (self.accepted + self.running)
        return max(0, min(by_concurrency, by_staleness))

    def leases(self, holder_id: str) -> int:
        """Episodes ``holder_id`` holds leases for."""
        return self._leases.get(holder_id, 0)

    # -- admission -----------------------------------------------------------------

    def try_acquire(self, holder_id: str, n_max: int = 1) -> Grant:
        """Grant up to ``n_max`` admissions now, without waiting (``n`` may be 0)."""
        if holder_id in self._dead:
            raise ValueError(f"holder {holder_id!r} was declared dead; a restarted holder needs a new id")
        self._stats.acquires += 1
        n = min(max(0, n_max), self.capacity())
        if n:
            self.running += n
            self._leases[holder_id] += n
            self._stats.granted += n
        return Grant(n, self.version)

    @rlactors.backpressure("rollout held under the staleness bound")
    async def acquire(self, holder_id: str, n_max: int = 1, timeout: float | None = 30.0) -> Grant:
        """Grant between 1 and ``n_max`` admissions, waiting (no polling) while capacity is 0.

        Wakes when the version advances or a slot frees. Returns ``Grant(0, v)`` on timeout,
        so a caller can re-check its own state (pause, shutdown) and ask again.
        """
        grant = self.try_acquire(holder_id, n_max)
        if grant.n or n_max <= 0:
            return grant
        self._stats.waits += 1
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not grant.n:
            changed = self._changed
            remaining = None if deadline is None else deadline - loop.time()
            try:
                if remaining is not None and remaining <= 0:
                    raise TimeoutError
                await wait_for(changed.wait(), remaining)
            except TimeoutError:
                self._stats.wait_timeouts += 1
                return Grant(0, self.version)
            grant = self.try_acquire(holder_id, n_max)
        return grant

    def finish(self, holder_id: str, k_accepted: int = 0, k_rejected: int = 0) -> None:
        """Release ``k_accepted + k_rejected`` of the holder's leases; accepted ones count as accepted.

        Accepted episodes are counted even when the holder's leases are already gone (its
        death notice overtook this message): the trajectory is real and will be consumed.
        """
        if k_accepted < 0 or k_rejected < 0:
            raise ValueError(f"finish counts must be >= 0, got {k_accepted}, {k_rejected}")
        held = self._leases.get(holder_id, 0)
        release = min(held, k_accepted + k_rejected)
        if release < k_accepted + k_rejected and holder_id not in self._dead:
            self._stats.over_finish += k_accepted + k_rejected - release
            log.warning("governor.over_finish", holder=holder_id, held=held, finished=k_accepted + k_rejected)
        self._release(holder_id, release)
        self.accepted += k_accepted
        self._stats.finished_accepted += k_accepted
        self._stats.finished_rejected += k_rejected
        self._notify()

    def discard(self, k: int) -> None:
        """``k`` accepted episodes will never be consumed (the buffer dropped them as stale)."""
        k = min(k, self.accepted)
        self.accepted -= k
        self._stats.discarded += k
        self._notify()

    def holder_died(self, holder_id: str) -> int:
        """Release every lease of a dead holder; returns how many. Idempotent."""
        if holder_id in self._dead:
            return 0
        self._dead.add(holder_id)
        n = self._leases.get(holder_id, 0)
        self._release(holder_id, n)
        self._stats.holder_deaths += 1
        self._stats.released_by_death += n
        log.info("governor.holder_died", holder=holder_id, released=n)
        self._notify()
        return n

    # -- version -------------------------------------------------------------------

    def set_version(self, version: int) -> None:
        """The trainer published ``version``; capacity grows by B per version."""
        if version < self.version:
            raise ValueError(
                f"version went backwards: {self.version} -> {version}; use recover() after a resume"
            )
        self.version = version
        self._notify()

    def set_servers(self, live: int, planned: int) -> None:
        """``live`` servers serve now where ``max_concurrent`` was set for ``planned``: scale it in
        proportion, so a pool that lost servers does not queue the same load on fewer, and one
        that grew fills the new ones."""
        self.max_concurrent = max(1, round(self.config.max_concurrent * live / max(1, planned)))
        self._notify()

    def recover(self, version: int) -> None:
        """Reset after a resume from a checkpoint at ``version``.

        Everything before the checkpoint was consumed (``version * B`` episodes) and nothing
        is running any more, so capacity is exactly ``(eta + 1) * B`` again — neither lost
        to leases of dead processes nor inflated by a zero ``accepted`` (AReaL #1388).
        """
        self.version = version
        self.accepted = version * self.config.batch_size
        self.running = 0
        self._leases.clear()
        self._stats.recoveries += 1
        self._notify()

    def stats(self) -> dict[str, Any]:
        """Counters and current state, flat, for logging."""
        s = self._stats
        return {
            "version": self.version,
            "running": self.running,
            "accepted": self.accepted,
            "capacity": self.capacity(),
            "max_concurrent": self.max_concurrent,
            "holders": len(self._leases),
            "acquires": s.acquires,
            "granted": s.granted,
            "waits": s.waits,
            "wait_timeouts": s.wait_timeouts,
            "finished_accepted": s.finished_accepted,
            "finished_rejected": s.finished_rejected,
            "holder_deaths": s.holder_deaths,
            "released_by_death": s.released_by_death,
            "discarded": s.discarded,
            "over_finish": s.over_finish,
            "recoveries": s.recoveries,
        }

    # -- internals -----------------------------------------------------------------

    def _release(self, holder_id: str, n: int) -> None:
        if n <= 0:
            return
        self.running -= n
        self._leases[holder_id] -= n
        if self._leases[holder_id] <= 0:
            del self._leases[holder_id]

    def _notify(self) -> None:
        """Wake every waiter (they re-check capacity): set the current event, start a fresh one."""
        self._changed.set()
        self._changed = asyncio.Event()


class GovernorActor(StalenessGovernor, rlactors.Actor, sync_methods="loop"):
    """The governor as an actor: one per job; rollout actors register, then acquire.

    Its methods are :class:`StalenessGovernor`'s, run on the actor's loop. Not meant to be
    restarted: its ledger (leases of running episodes, accepted count) exists only here, and a
    fresh one would admit past the staleness bound. If it dies, the job stops and resumes from a
    checkpoint (:meth:`recover`).
    """

    def __init__(self, config: GovernorConfig, version: int = 0) -> None:
        super().__init__(config, version)

    def register(self, holder_id: str, actor_id: str) -> None:
        """Watch the holder's actor: its death releases its leases. Idempotent."""
        rlactors.get_context().watch(actor_id, self.holder_died, holder_id)

    def max_staleness(self) -> int:
        """The bound eta (a buffer without its own bound takes this one)."""
        return self.config.max_staleness
