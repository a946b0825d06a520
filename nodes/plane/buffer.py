"""Trajectory buffer: accepted trajectory groups, handed to the trainer in batches of whole groups.

Guarantees:
- *Exactly once.* ``put`` is idempotent by group id (a retried or re-run episode cannot
  duplicate a group, duplicates are counted), and a group handed out is never handed out
  again.
- *Never half-recorded.* Episodes in flight are tracked per holder (rollout actor) from
  ``begin`` to ``put``/``abandon``; a group becomes visible only whole, in one ``put``.
  When a holder dies, its in-flight episodes are re-queued to be re-run from their prompt
  (or, configured so, reported as lost).
- *Bounded staleness.* Groups are handed out oldest admission version first. With
  ``order="admission"`` a group is held back while an episode admitted at an older version
  is still in flight: consumption then follows admission-version order, which is what the
  governor's capacity formula needs to guarantee staleness <= eta without dropping work
  (see nodes/plane/governor.py). With ``order="arrival"`` ready groups go out at once and
  stragglers that fell behind are dropped. Either way, when ``max_staleness`` is set, a
  group whose oldest token is more than ``max_staleness`` versions behind the consuming
  version is dropped (counted, and reported to the governor) rather than trained on.
- *Dynamic sampling* (DAPO's, off by default: ``drop_no_signal``). A group whose rewards are all
  equal has zero group-normalised advantage, so no gradient under GRPO: it is dropped at ``put``
  instead of taking a batch slot, counted (``dropped_no_signal``), and its lease goes back to the
  governor as a rejected episode, so the governor admits a replacement and batches stay full. A
  dropped prompt counts as *seen* for its epoch: its id is refused like a trained one's (not
  generated again this epoch) and handed to the run's record by :meth:`TrajectoryBuffer.take_dropped`,
  so checkpoints count it too.

The buffer owns the release of every lease whose ``begin`` it saw: it tells the governor
(through a :class:`GovernorLink`) when an episode is accepted, rejected, or dropped.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import heapq
import itertools
import time
from collections import Counter, deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import structlog

import rlactors
from protocols.rl import Batch, TrajectoryGroup
from protocols.runtime.codec import register
from rlactors.base.aio import wait_for
from rlactors.base.tomlconf import at_least, check_ranges

__all__ = [
    "BufferActor",
    "BufferConfig",
    "GovernorLink",
    "RepeatedFailureError",
    "TrajectoryBuffer",
    "has_reward_variance",
]

log = structlog.get_logger(__name__)


class RepeatedFailureError(RuntimeError):
    """The run's episodes fail again and again (a broken reward function, rubric, environment or
    agent): training cannot learn from them. The message is one line naming what failed."""


class GovernorLink(Protocol):
    """What the buffer tells the governor (StalenessGovernor itself, or a proxy to its actor)."""

    def finish(self, holder_id: str, k_accepted: int = 0, k_rejected: int = 0) -> Any: ...

    def discard(self, k: int) -> Any: ...


@register
@dataclass
class BufferConfig:
    """How the buffer orders groups and what it does with stale ones and dead holders' episodes
    (``[buffer]``)."""

    # groups older than this at the batch are dropped; None: the governor's bound (BufferActor)
    max_staleness: int | None = field(default=None, metadata=at_least(0))
    order: Literal["admission", "arrival"] = "admission"  # oldest admission first, or first come
    on_holder_death: Literal["requeue", "report"] = "requeue"  # re-run a dead actor's episodes, or list them
    # DAPO dynamic sampling: drop groups whose rewards are all equal (no GRPO signal), admit others.
    # Off by default: it costs generation (a dropped group's tokens are wasted) and its benefit to
    # learning here is not measured yet. A group of one trajectory never has signal: leave it off.
    drop_no_signal: bool = False

    def __post_init__(self) -> None:
        check_ranges(self)
        if self.order not in ("admission", "arrival"):
            raise ValueError(f"'order' must be 'admission' or 'arrival', got {self.order!r}")
        if self.on_holder_death not in ("requeue", "report"):
            raise ValueError(f"'on_holder_death' must be 'requeue' or 'report', got {self.on_holder_death!r}")


def has_reward_variance(group: TrajectoryGroup) -> bool:
    """Whether ``group``'s rewards differ (exactly): otherwise every group-normalised advantage is 0
    and the group carries no signal under GRPO. Judged on the rewards as put, before any shaping."""
    rewards = group.rewards
    return any(r != rewards[0] for r in rewards[1:])


@dataclass
class _InFlight:
    holder_id: str
    group_id: str
    item: Any
    admit_version: int
    since: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class _Ready:
    admit_version: int
    seq: int
    group: TrajectoryGroup
    age_version: int  # staleness is measured from it: the oldest token's version, else the admission's
    gone: bool = False  # taken or dropped; still referenced from a queue or the age heap until passed


class _ReadyGroups:
    """Ready groups in hand-out order (admission version, then arrival), with cheap stale drops.

    Every wake-up of a waiting trainer asks for the eligible count and drops stale groups, so
    neither may rescan the groups waiting: groups live in one FIFO per admission version (a few
    versions at a time), a heap orders them by age, and a group that leaves is only marked, then
    passed over once by each structure. Work per group is O(log n) over its stay, not per wake-up.
    """

    def __init__(self) -> None:
        self._queues: dict[int, deque[_Ready]] = {}  # admission version -> its groups by arrival
        self._live: Counter[int] = Counter()  # admission version -> groups not gone
        self._versions: list[int] = []  # admission versions with live groups, ascending
        self._by_age: list[tuple[int, int, _Ready]] = []  # heap of (age_version, seq, group)
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[_Ready]:
        for v in self._versions:
            yield from (r for r in self._queues[v] if not r.gone)

    def add(self, r: _Ready) -> None:
        """Append ``r`` (its ``seq`` is the newest) behind the groups of its admission version."""
        v = r.admit_version
        if v not in self._queues:
            self._queues[v] = deque()
            bisect.insort(self._versions, v)
        self._queues[v].append(r)
        self._live[v] += 1
        self._n += 1
        heapq.heappush(self._by_age, (r.age_version, r.seq, r))
        if len(self._by_age) > 2 * self._n + 64:  # mostly groups already gone: rebuild, amortised O(1)
            self._by_age = [e for e in self._by_age if not e[2].gone]
            heapq.heapify(self._by_age)

    def eligible(self, horizon: int | None) -> int:
        """Groups admitted at ``horizon`` or before (all of them with None)."""
        if horizon is None:
            return self._n
        n = 0
        for v in self._versions:
            if v > horizon:
                break
            n += self._live[v]
        return n

    def drop_older_than(self, age: int) -> int:
        """Drop the groups whose age version is below ``age``; how many."""
        dropped = 0
        while self._by_age and self._by_age[0][0] < age:
            r = heapq.heappop(self._by_age)[2]
            if not r.gone:
                self._leave(r)
                dropped += 1
        return dropped

    def take(self, n: int) -> list[_Ready]:
        """The first ``n`` groups in hand-out order (fewer if fewer are ready), removed."""
        out: list[_Ready] = []
        while len(out) < n and self._versions:
            q = self._queues[self._versions[0]]
            r = q.popleft()
            if not r.gone:
                self._leave(r)
                out.append(r)
        return out

    def _leave(self, r: _Ready) -> None:
        r.gone = True
        self._n -= 1
        v = r.admit_version
        self._live[v] -= 1
        if not self._live[v]:  # its queue holds only gone groups now: forget it
            del self._live[v], self._queues[v]
            self._versions.remove(v)


class TrajectoryBuffer:
    """Plain-logic buffer; :class:`BufferActor` serves it with death notices and a governor link."""

    def __init__(
        self,
        config: BufferConfig | None = None,
        governor: GovernorLink | None = None,
        done_ids: Iterable[str] = (),
    ) -> None:
        """``done_ids``: groups trained before a restart; their ``begin`` is refused like an accepted one's."""
        self.config = config or BufferConfig()
        self._governor = governor
        self._ready = _ReadyGroups()
        self._in_flight: dict[tuple[str, str], _InFlight] = {}  # (holder, group_id) -> episode
        self._flight_versions: Counter[int] = Counter()  # admission versions of episodes in flight
        self._accepted_ids: set[str] = set(done_ids)  # and the groups dropped for no signal: seen
        self._dropped: list[str] = []  # dropped for no signal since the last take_dropped
        self._requeue: deque[_InFlight] = deque()
        self._dead: set[str] = set()
        self._seq = itertools.count()
        self._changed = asyncio.Event()
        self._c = dict.fromkeys(
            (
                "begun",
                "accepted",
                "duplicates",
                "abandoned",
                "refused_begin",
                "requeued",
                "reported_lost",
                "late_puts",
                "dropped_stale",
                "dropped_no_signal",
                "batches",
                "groups_out",
            ),
            0,
        )
        self.lost: list[dict[str, Any]] = []  # episodes of dead holders, in "report" mode
        self.failure: str | None = None  # failures that repeat (fail()): get_batch raises it

    # -- rollout side --------------------------------------------------------------

    def begin(self, holder_id: str, group_id: str, item: Any, admit_version: int) -> bool:
        """Record an admitted episode as in flight. False (lease released) if the group is already in."""
        if group_id in self._accepted_ids:
            self._c["refused_begin"] += 1
            self._tell_finish(holder_id, 0, 1)
            return False
        key = (holder_id, group_id)
        if key in self._in_flight:
            raise ValueError(f"buffer: {holder_id!r} began group {group_id!r} twice")
        self._in_flight[key] = _InFlight(holder_id, group_id, item, admit_version)
        self._flight_versions[admit_version] += 1
        self._c["begun"] += 1
        return True

    def begin_many(self, holder_id: str, episodes: Sequence[Sequence[Any]], admit_version: int) -> list[bool]:
        """:meth:`begin` a grant's episodes, ``(group_id, item)`` pairs, in one call (one round trip
        per grant, not per episode). Checked first: if one is in flight for ``holder_id`` already, or
        named twice, ValueError and nothing is recorded.

        Unlike :meth:`begin`, a refused one (its group was accepted) leaves its lease with the caller,
        who returns it to the governor: so each lease is settled once even if this answer is lost (the
        caller then abandons each; what the buffer did not record, the caller returns)."""
        gids = [str(e[0]) for e in episodes]
        if len(set(gids)) < len(gids):
            raise ValueError(f"buffer: {holder_id!r} began a group twice in one call: {gids}")
        twice = [g for g in gids if (holder_id, g) in self._in_flight]
        if twice:
            raise ValueError(f"buffer: {holder_id!r} began groups {twice} twice")
        out = []
        for (_, item), group_id in zip(episodes, gids, strict=True):
            if group_id in self._accepted_ids:
                self._c["refused_begin"] += 1
                out.append(False)
            else:
                out.append(self.begin(holder_id, group_id, item, admit_version))
        return out

    def put(self, holder_id: str, group: TrajectoryGroup, admit_version: int | None = None) -> bool:
        """Accept a finished group (True), or ignore a duplicate or drop a group with no signal
        (False; see ``drop_no_signal``). The group must be valid."""
        group.validate()
        episode = self._pop_in_flight(holder_id, group.group_id)
        if group.group_id in self._accepted_ids:
            self._c["duplicates"] += 1
            if episode is not None:
                self._tell_finish(holder_id, 0, 1)
            log.info("buffer.duplicate_put", holder=holder_id, group=group.group_id)
            self._notify()
            return False
        if episode is None and holder_id in self._dead:
            self._c["late_puts"] += 1
            self._drop_requeued(group.group_id)
        if self.config.drop_no_signal and not has_reward_variance(group):
            return self._drop_no_signal(holder_id, group.group_id, episode is not None)
        oldest = group.oldest_version  # the one scan of the group's tokens
        if admit_version is None:
            admit_version = episode.admit_version if episode else max(oldest, 0)
        self._accepted_ids.add(group.group_id)
        age = oldest if oldest >= 0 else admit_version
        self._ready.add(_Ready(admit_version, next(self._seq), group, age))
        self._c["accepted"] += 1
        self._tell_finish(holder_id, 1, 0)
        self._notify()
        return True

    def _drop_no_signal(self, holder_id: str, group_id: str, held: bool) -> bool:
        """Drop a group with equal rewards: seen (its ``begin`` is refused), never handed out; its
        lease released as rejected, so the governor admits a replacement. False, as put's answer."""
        self._accepted_ids.add(group_id)
        self._dropped.append(group_id)
        self._c["dropped_no_signal"] += 1
        if held:  # a dead holder's lease is the governor's to release, on its death notice
            self._tell_finish(holder_id, 0, 1)
        log.debug("buffer.dropped_no_signal", holder=holder_id, group=group_id)
        self._notify()
        return False

    def abandon(self, holder_id: str, group_id: str) -> bool:
        """The episode ended without a group (rejected or failed): release its lease."""
        episode = self._pop_in_flight(holder_id, group_id)
        if episode is None:
            return False
        self._c["abandoned"] += 1
        self._tell_finish(holder_id, 0, 1)
        self._notify()
        return True

    def holder_died(self, holder_id: str) -> list[dict[str, Any]]:
        """Take a dead holder's in-flight episodes off the books: re-queue or report them. Idempotent."""
        if holder_id in self._dead:
            return []
        self._dead.add(holder_id)
        orphans = [e for k, e in self._in_flight.items() if k[0] == holder_id]
        for e in orphans:
            self._pop_in_flight(holder_id, e.group_id)
        out = [{"group_id": e.group_id, "item": e.item, "admit_version": e.admit_version} for e in orphans]
        if self.config.on_holder_death == "requeue":
            self._requeue.extend(orphans)
            self._c["requeued"] += len(orphans)
        else:
            self.lost.extend(out)
            self._c["reported_lost"] += len(orphans)
        log.info(
            "buffer.holder_died", holder=holder_id, orphans=len(orphans), action=self.config.on_holder_death
        )
        self._notify()
        return out

    def take_requeued(
        self, n: int, holder_id: str | None = None, admit_version: int | None = None
    ) -> list[dict[str, Any]]:
        """Up to ``n`` episodes of dead holders to re-run from their prompt, with their group ids.

        With ``holder_id`` (and ``admit_version``) each one taken is begun for that holder in
        the same call, so none can fall between the requeue and the in-flight books."""
        out: list[dict[str, Any]] = []
        while self._requeue and len(out) < n:
            e = self._requeue.popleft()
            if e.group_id in self._accepted_ids or any(o["group_id"] == e.group_id for o in out):
                continue  # trained already, or queued twice (two dead incarnations held it)
            if holder_id is not None:
                if (holder_id, e.group_id) in self._in_flight:
                    continue  # this holder already runs it (a restarted one replaying its source)
                version = e.admit_version if admit_version is None else admit_version
                self.begin(holder_id, e.group_id, e.item, version)
            out.append({"group_id": e.group_id, "item": e.item})
        return out

    # -- trainer side --------------------------------------------------------------

    def try_get_batch(self, batch_size: int, version: int) -> Batch | None:
        """B whole groups for training at ``version`` if that many are eligible, else None."""
        self._drop_stale(version)
        eligible = self._eligible_count()
        if eligible < batch_size:
            return None
        taken = self._ready.take(batch_size)
        self._c["batches"] += 1
        self._c["groups_out"] += batch_size
        return Batch([r.group for r in taken], version)

    @rlactors.backpressure("the trainer waits for groups")
    async def get_batch(self, batch_size: int, version: int, timeout: float | None = 60.0) -> Batch:
        """Wait (no polling) until ``batch_size`` groups are eligible; TimeoutError after ``timeout`` s,
        :class:`RepeatedFailureError` once a rollout actor said its failures
        repeat (:meth:`fail`)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while (batch := self.try_get_batch(batch_size, version)) is None:
            if self.failure is not None:
                raise RepeatedFailureError(self.failure)
            changed = self._changed
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(
                    f"buffer: {self._eligible_count()} of {batch_size} groups ready after {timeout} s "
                    f"(ready {len(self._ready)}, in flight {len(self._in_flight)}, version {version})"
                )
            try:
                await wait_for(changed.wait(), remaining)
            except TimeoutError:
                continue
        return batch

    def fail(self, line: str) -> None:
        """A rollout actor's episodes fail again and again (nodes/rollout/failures.py): the trainer's
        wait for a batch ends with :class:`RepeatedFailureError` and ``line`` (the first one given)."""
        if self.failure is None:
            self.failure = line
            self._notify()

    # -- introspection -------------------------------------------------------------

    @property
    def ready(self) -> int:
        """Groups accepted and not yet handed out."""
        return len(self._ready)

    @property
    def in_flight(self) -> int:
        """Episodes begun and not yet put or abandoned."""
        return len(self._in_flight)

    def ready_group_ids(self) -> list[str]:
        """Ids of groups waiting to be handed out, in hand-out order."""
        return [r.group.group_id for r in self._ready]

    def accepted_ids(self) -> list[str]:
        """Ids of every group accepted or dropped for no signal (or trained before a resume): their
        ``begin`` is refused."""
        return sorted(self._accepted_ids)

    def take_dropped(self) -> list[str]:
        """Ids of the groups dropped for no signal since the last call, for the run's record of what
        its epoch has seen (``RunState.record(..., seen=)``); each id is returned once."""
        out, self._dropped = self._dropped, []
        return out

    def oldest_in_flight(self) -> dict[str, Any] | None:
        """The episode in flight the longest: ``{group, holder, actor_id, age_s}`` (the actor that
        holds it), or None; what a stall watchdog asks."""
        if not self._in_flight:
            return None
        e = min(self._in_flight.values(), key=lambda e: e.since)
        return {
            "group": e.group_id,
            "holder": e.holder_id,
            "actor_id": e.holder_id.split(":")[0],
            "age_s": time.monotonic() - e.since,
        }

    def stats(self) -> dict[str, Any]:
        """Counters and sizes, flat, for logging."""
        return {
            **self._c,
            "ready": len(self._ready),
            "in_flight": len(self._in_flight),
            "requeue_pending": len(self._requeue),
            "max_staleness": self.config.max_staleness,
        }

    # -- internals -----------------------------------------------------------------

    def _eligible_count(self) -> int:
        if self.config.order == "arrival" or not self._in_flight:
            return self._ready.eligible(None)
        return self._ready.eligible(min(self._flight_versions))

    def _drop_stale(self, version: int) -> None:
        eta = self.config.max_staleness
        if eta is None:
            return
        dropped = self._ready.drop_older_than(version - eta)
        if dropped:
            self._c["dropped_stale"] += dropped
            log.warning("buffer.dropped_stale", n=dropped, version=version, max_staleness=eta)
            if self._governor is not None:
                self._governor.discard(dropped)

    def _pop_in_flight(self, holder_id: str, group_id: str) -> _InFlight | None:
        episode = self._in_flight.pop((holder_id, group_id), None)
        if episode is not None:
            self._flight_versions[episode.admit_version] -= 1
            if not self._flight_versions[episode.admit_version]:
                del self._flight_versions[episode.admit_version]
        return episode

    def _drop_requeued(self, group_id: str) -> None:
        self._requeue = deque(e for e in self._requeue if e.group_id != group_id)

    def _tell_finish(self, holder_id: str, k_accepted: int, k_rejected: int) -> None:
        if self._governor is not None:
            self._governor.finish(holder_id, k_accepted, k_rejected)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


class _GovernorProxy:
    """GovernorLink over an actor handle: ordered fire-and-forget messages from this buffer."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def finish(self, holder_id: str, k_accepted: int = 0, k_rejected: int = 0) -> None:
        self.handle.finish.tell(holder_id, k_accepted, k_rejected)

    def discard(self, k: int) -> None:
        self.handle.discard.tell(k)


class BufferActor(TrajectoryBuffer, rlactors.Actor, sync_methods="loop"):
    """The buffer as an actor. ``governor`` is the governor's handle or name (or None).

    Its methods are :class:`TrajectoryBuffer`'s, run on the actor's loop. Not meant to be
    restarted: accepted groups not yet trained and the books of episodes in flight exist only
    here, so a fresh one would lose groups and let replayed prompts be trained twice. If it
    dies, the job stops and resumes from a checkpoint (``done_ids``).
    """

    def __init__(
        self, governor: Any = None, config: BufferConfig | None = None, done_ids: Sequence[str] = ()
    ) -> None:
        super().__init__(dataclasses.replace(config) if config else BufferConfig(), done_ids=done_ids)
        self._governor_ref = governor

    async def on_start(self) -> None:
        g = self._governor_ref
        if isinstance(g, str):
            g = await rlactors.get_context().cluster.get_actor(g)
        if g is not None:
            self._governor = _GovernorProxy(g)
            if self.config.max_staleness is None:  # the governor's bound, also at the batch
                self.config.max_staleness = await g.max_staleness()

    def register(self, holder_id: str, actor_id: str) -> None:
        """Watch the holder's actor: on its death its in-flight episodes are re-queued or reported."""
        rlactors.get_context().watch(actor_id, self.holder_died, holder_id)

    def lost_episodes(self) -> list[dict[str, Any]]:
        """Episodes of dead holders, in "report" mode (:attr:`TrajectoryBuffer.lost`)."""
        return list(self.lost)
