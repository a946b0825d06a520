"""Stateful property tests: governor + buffer + a modelled trainer under random interleavings.

The model runs rollout holders (admit episodes in batches, generate tokens stamped with
the holder's possibly lagging view of the version, finish by put or abandon), holder
deaths whose notices reach the governor and the buffer separately (and late puts from
dead holders), and a trainer that takes B groups at version v, then later publishes v+1.

Checked after every step: counts never negative, running <= C, every grant respects the
capacity formula, live holders' leases equal their unfinished episodes, the governor's
``accepted`` equals what the buffer accepted minus what it dropped; at every consumption
no trajectory is older than eta versions and no group is handed out twice; at the end,
once every notice is delivered and every episode finished, the ledgers balance exactly.

Three set-ups:
- ``admission`` order with *no* staleness filter and no late puts: AReaL's argument alone
  (admission versions + the capacity formula + admission-order consumption) must keep
  staleness <= eta — nothing is dropped because nothing can be.
- ``admission`` order with the filter, late puts allowed (a dead holder's put overtaking
  its death notice can transiently inflate capacity; the filter catches it).
- ``arrival`` order with the filter: completion order can overtake stragglers, so the
  bound holds only because stale groups are dropped (counted).
Each again with dynamic sampling (``drop_no_signal``): some groups finish with equal rewards and
are dropped at ``put``. Then also: no dropped group is ever handed out, every group handed out has
reward variance, a replay of a dropped (or trained) prompt is refused (seen for its epoch), and
the drops' leases come back (the governor's ``accepted`` counts only what the buffer accepted, and
live holders' leases still equal their episodes) so replacements are admitted and batches stay full.
``test_arrival_order_without_filter_can_violate_the_bound`` shows the last point is real.
"""

from __future__ import annotations

import asyncio
import itertools
import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from nodes.plane.buffer import BufferConfig, TrajectoryBuffer
from nodes.plane.governor import GovernorConfig, StalenessGovernor
from protocols.rl import Trajectory, TrajectoryGroup
from rlactors.base.aio import wait_for


def make_group(gid: str, versions: list[int], signal: bool = True) -> TrajectoryGroup:
    """Two samples with the token versions ``versions``; their rewards differ if ``signal``."""
    n = len(versions)
    ts = [
        Trajectory(
            input_ids=[1, *range(2, 2 + n)],
            loss_mask=[0] + [1] * n,
            logprobs=[0.0] + [-1.0] * n,
            versions=[-1, *versions],
            reward=reward,
            group_id=gid,
            prompt_len=1,
        )
        for reward in ((0.0, 1.0) if signal else (1.0, 1.0))
    ]
    return TrajectoryGroup(gid, ts)


class Episode:
    def __init__(self, gid: str, holder: str, admit_version: int) -> None:
        self.gid, self.holder, self.admit_version = gid, holder, admit_version
        self.versions: list[int] = []
        self.signal = True  # its rewards will differ; drawn when it finishes


class World:
    """The modelled system — governor, buffer, rollout holders, trainer — driven by explicit choices."""

    def __init__(
        self, B: int, eta: int, C: int, order: str, filtered: bool, late_puts: bool, drops: bool = False
    ) -> None:
        self.B, self.eta, self.C, self.filtered, self.late_puts = B, eta, C, filtered, late_puts
        self.drops = drops
        self.gov = StalenessGovernor(GovernorConfig(B, eta, C))
        cfg = BufferConfig(max_staleness=eta if filtered else None, order=order, drop_no_signal=drops)  # type: ignore[arg-type]
        self.buf = TrajectoryBuffer(cfg, governor=self.gov)
        self.version = 0  # the trainer's published version
        self.trainer_busy = False  # took a batch at self.version, has not published version + 1 yet
        self.holder_ids = itertools.count()
        self.alive: dict[str, int] = {}  # holder -> its view of the version (set_version arrives late)
        self.unfinished: dict[str, list[Episode]] = {}
        self.zombies: list[Episode] = []  # dead holders' finished episodes whose put is still on the wire
        self.pending_gov_death: list[str] = []
        self.pending_buf_death: list[str] = []
        self.gov_notified_dead: set[str] = set()
        self.prompts = itertools.count()
        self.handed_out: set[str] = set()
        self.dropped: set[str] = set()  # dropped for no signal (the buffer's take_dropped)
        self.consumed = 0
        self.spawn_holder()
        self.spawn_holder()

    # -- actions --------------------------------------------------------------------

    def spawn_holder(self) -> None:
        h = f"h{next(self.holder_ids)}"
        self.alive[h] = self.gov.version
        self.unfinished[h] = []

    def admit(self, h: str, n_max: int) -> None:
        g, v = self.gov, self.gov.version
        formula = min(self.C - g.running, (self.eta + v + 1) * self.B - (g.accepted + g.running))
        cap = g.capacity()
        assert cap == max(0, formula)
        grant = g.try_acquire(h, n_max)
        assert grant.n == min(n_max, cap) and grant.version == v
        if grant.n:
            assert g.running <= self.C
            assert g.accepted + g.running <= (self.eta + v + 1) * self.B
        self.alive[h] = max(self.alive[h], grant.version)  # a grant carries the version: the view catches up
        requeued = self.buf.take_requeued(grant.n)
        for i in range(grant.n):
            gid = requeued[i]["group_id"] if i < len(requeued) else f"p{next(self.prompts)}"
            if self.buf.begin(h, gid, {"prompt": gid}, grant.version):
                e = Episode(gid, h, grant.version)
                e.versions.append(self.alive[h])  # generation starts at once: first token at admission
                self.unfinished[h].append(e)

    def generate(self, h: str, i: int) -> None:
        self.unfinished[h][i].versions.append(self.alive[h])  # stamped with the version the client knows

    def finish(self, h: str, i: int, accept: bool, signal: bool = True) -> None:
        e = self.unfinished[h].pop(i)
        e.signal = signal
        if accept:
            self.put(h, e)
        else:
            self.buf.abandon(h, e.gid)

    def put(self, h: str, e: Episode) -> None:
        seen = e.gid in self.buf.accepted_ids()
        accepted = self.buf.put(h, make_group(e.gid, e.versions, e.signal))
        assert accepted == (not seen and (e.signal or not self.drops))
        self.dropped.update(self.buf.take_dropped())

    def replay(self, h: str, pick: int) -> None:
        """A restarted actor asks again for a prompt already trained or dropped: refused, lease back."""
        seen = sorted(self.handed_out | self.dropped)
        if not seen or not self.gov.try_acquire(h, 1).n:
            return
        assert not self.buf.begin(h, seen[pick % len(seen)], None, self.gov.version)

    def kill(self, h: str) -> None:
        del self.alive[h]
        orphans = self.unfinished.pop(h)
        if self.late_puts:
            self.zombies.extend(orphans)
        self.pending_gov_death.append(h)
        self.pending_buf_death.append(h)
        self.spawn_holder()  # the runtime restarts it under a new holder id

    def governor_learns_death(self, i: int) -> None:
        h = self.pending_gov_death.pop(i)
        self.gov.holder_died(h)
        self.gov_notified_dead.add(h)
        assert self.gov.leases(h) == 0

    def buffer_learns_death(self, i: int) -> None:
        self.buf.holder_died(self.pending_buf_death.pop(i))

    def late_put(self, i: int) -> None:
        e = self.zombies.pop(i)
        self.put(e.holder, e)

    def consume(self) -> None:
        batch = self.buf.try_get_batch(self.B, self.version)
        if batch is None:
            return
        assert len(batch.groups) == self.B and batch.version == self.version
        for g in batch.groups:
            assert g.group_id not in self.handed_out, f"group {g.group_id} handed out twice"
            assert g.group_id not in self.dropped, f"group {g.group_id} dropped, then handed out"
            assert not self.drops or len(set(g.rewards)) > 1, f"group {g.group_id} without signal trained"
            self.handed_out.add(g.group_id)
            for t in g.trajectories:
                assert t.oldest_version >= self.version - self.eta, (
                    f"{t.group_id}: oldest token version {t.oldest_version} consumed at {self.version}, eta {self.eta}"
                )
        self.consumed += self.B
        self.trainer_busy = True

    def publish(self, told: list[str]) -> None:
        self.version += 1
        self.gov.set_version(self.version)
        self.trainer_busy = False
        for h in told:  # set_version reaches rollout holders one by one; the rest keep an old view
            self.alive[h] = self.version

    def random_step(self, rnd: random.Random) -> None:
        """One action, chosen with weights that favour long runs with stragglers."""
        busy = [h for h, es in self.unfinished.items() if es]
        options = [("admit", 3), ("consume", 3), ("publish", 3), ("finish", 4 if busy else 0),
                   ("generate", 1 if busy else 0), ("kill", 0.3), ("gov_death", 1 if self.pending_gov_death else 0),
                   ("buf_death", 1 if self.pending_buf_death else 0), ("late_put", 1 if self.zombies else 0)]  # fmt: skip
        options += [("replay", 0.5)]
        options = [(a, w) for a, w in options if w]
        action = rnd.choices([a for a, _ in options], [w for _, w in options])[0]
        if action == "admit":
            self.admit(rnd.choice(sorted(self.alive)), rnd.randint(1, 4))
        elif action == "consume" and not self.trainer_busy:
            self.consume()
        elif action == "publish" and self.trainer_busy:
            self.publish([h for h in sorted(self.alive) if rnd.random() < 0.5])
        elif action in ("finish", "generate"):
            h = rnd.choice(busy)
            n = len(self.unfinished[h])
            i = n - 1 if rnd.random() < 0.6 else rnd.randrange(n)  # mostly the newest: old ones straggle
            if action == "finish":
                self.finish(h, i, rnd.random() < 0.8, signal=rnd.random() < 0.6)
            else:
                self.generate(h, i)
        elif action == "kill":
            self.kill(rnd.choice(sorted(self.alive)))
        elif action == "gov_death":
            self.governor_learns_death(rnd.randrange(len(self.pending_gov_death)))
        elif action == "buf_death":
            self.buffer_learns_death(rnd.randrange(len(self.pending_buf_death)))
        elif action == "late_put":
            self.late_put(rnd.randrange(len(self.zombies)))
        elif action == "replay":
            self.replay(rnd.choice(sorted(self.alive)), rnd.randrange(1 << 16))

    # -- checks ---------------------------------------------------------------------

    def check(self) -> None:
        g, b = self.gov, self.buf.stats()
        assert g.running >= 0 and g.accepted >= 0
        assert g.running <= self.C
        assert 0 <= g.capacity() <= self.C
        assert g.accepted == b["accepted"] - b["dropped_stale"]
        for h, episodes in self.unfinished.items():
            assert g.leases(h) == len(episodes), f"holder {h}: {g.leases(h)} leases, {len(episodes)} episodes"
        for h in self.gov_notified_dead:
            assert g.leases(h) == 0
        if not self.filtered:
            assert b["dropped_stale"] == 0
        assert b["dropped_no_signal"] == len(self.dropped) and (self.drops or not self.dropped)
        assert not self.dropped & (self.handed_out | set(self.buf.ready_group_ids()))

    def quiesce_and_check(self) -> None:
        """Deliver every notice, finish every episode: the books must then balance exactly."""
        while self.pending_gov_death:
            self.governor_learns_death(0)
        while self.pending_buf_death:
            self.buffer_learns_death(0)
        while self.zombies:
            self.late_put(0)
        for h, es in self.unfinished.items():
            for e in es:
                self.buf.abandon(h, e.gid)
        assert self.gov.running == 0
        assert self.buf.in_flight == 0
        assert self.gov.accepted == self.consumed + self.buf.ready
        assert not set(self.buf.ready_group_ids()) & self.handed_out


class StalenessMachine(RuleBasedStateMachine):
    """Hypothesis drives the World: single chosen actions, and seeded random schedules of many."""

    order, filtered, late_puts, drops = "admission", False, False, False  # set by the subclasses below

    @initialize(B=st.integers(1, 3), eta=st.integers(0, 3), C=st.integers(1, 12))
    def setup(self, B: int, eta: int, C: int) -> None:
        self.w = World(B, eta, C, self.order, self.filtered, self.late_puts, self.drops)

    @rule(data=st.data(), n_max=st.integers(1, 4))
    def admit(self, data: st.DataObject, n_max: int) -> None:
        self.w.admit(data.draw(st.sampled_from(sorted(self.w.alive))), n_max)

    @rule(data=st.data(), accept=st.booleans(), generate=st.booleans(), signal=st.booleans())
    def finish_or_generate(self, data: st.DataObject, accept: bool, generate: bool, signal: bool) -> None:
        busy = sorted(h for h, es in self.w.unfinished.items() if es)
        if busy:
            h = data.draw(st.sampled_from(busy))
            i = len(self.w.unfinished[h]) - 1 - data.draw(st.integers(0, len(self.w.unfinished[h]) - 1))
            self.w.generate(h, i) if generate else self.w.finish(h, i, accept, signal)

    @rule(data=st.data(), pick=st.integers(0, 1 << 16))
    def replay(self, data: st.DataObject, pick: int) -> None:
        self.w.replay(data.draw(st.sampled_from(sorted(self.w.alive))), pick)

    @rule(data=st.data())
    def train_step(self, data: st.DataObject) -> None:
        if self.w.trainer_busy:
            self.w.publish(data.draw(st.lists(st.sampled_from(sorted(self.w.alive)), unique=True)))
        else:
            self.w.consume()

    @rule(data=st.data())
    def kill_or_notify(self, data: st.DataObject) -> None:
        w = self.w
        choice = data.draw(st.sampled_from(["kill", "gov", "buf", "late"]))
        if choice == "kill":
            w.kill(data.draw(st.sampled_from(sorted(w.alive))))
        elif choice == "gov" and w.pending_gov_death:
            w.governor_learns_death(data.draw(st.integers(0, len(w.pending_gov_death) - 1)))
        elif choice == "buf" and w.pending_buf_death:
            w.buffer_learns_death(data.draw(st.integers(0, len(w.pending_buf_death) - 1)))
        elif choice == "late" and w.zombies:
            w.late_put(data.draw(st.integers(0, len(w.zombies) - 1)))

    @rule(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 300))
    def random_schedule(self, seed: int, n: int) -> None:
        """Many weighted random actions from a seeded PRNG: reaches the deep schedules (a
        straggler overtaken by several train steps) that one-action-per-rule search, and
        hypothesis's own minimal-value-biased randoms, rarely assemble."""
        rnd = random.Random(seed)
        for _ in range(n):
            self.w.random_step(rnd)
            self.w.check()

    @invariant()
    def ledgers_agree(self) -> None:
        if hasattr(self, "w"):
            self.w.check()

    def teardown(self) -> None:
        if hasattr(self, "w"):
            self.w.quiesce_and_check()


class AdmissionOrderNoFilter(StalenessMachine):
    order, filtered, late_puts = "admission", False, False


class AdmissionOrderFiltered(StalenessMachine):
    order, filtered, late_puts = "admission", True, True


class ArrivalOrderFiltered(StalenessMachine):
    order, filtered, late_puts = "arrival", True, True


class AdmissionOrderNoFilterDrops(StalenessMachine):
    order, filtered, late_puts, drops = "admission", False, False, True


class AdmissionOrderFilteredDrops(StalenessMachine):
    order, filtered, late_puts, drops = "admission", True, True, True


class ArrivalOrderFilteredDrops(StalenessMachine):
    order, filtered, late_puts, drops = "arrival", True, True, True


_settings = settings(
    max_examples=100, stateful_step_count=20, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestAdmissionOrderNoFilter = AdmissionOrderNoFilter.TestCase
TestAdmissionOrderNoFilter.settings = _settings
TestAdmissionOrderFiltered = AdmissionOrderFiltered.TestCase
TestAdmissionOrderFiltered.settings = _settings
TestArrivalOrderFiltered = ArrivalOrderFiltered.TestCase
TestArrivalOrderFiltered.settings = _settings
TestAdmissionOrderNoFilterDrops = AdmissionOrderNoFilterDrops.TestCase
TestAdmissionOrderNoFilterDrops.settings = _settings
TestAdmissionOrderFilteredDrops = AdmissionOrderFilteredDrops.TestCase
TestAdmissionOrderFilteredDrops.settings = _settings
TestArrivalOrderFilteredDrops = ArrivalOrderFilteredDrops.TestCase
TestArrivalOrderFilteredDrops.settings = _settings


def test_arrival_order_without_filter_can_violate_the_bound() -> None:
    """Why the buffer orders by admission: completion order lets a straggler go stale (eta=1, B=1)."""
    gov = StalenessGovernor(GovernorConfig(batch_size=1, max_staleness=1, max_concurrent=8))
    buf = TrajectoryBuffer(BufferConfig(max_staleness=None, order="arrival"), governor=gov)
    assert gov.try_acquire("h", 2).n == 2  # T (straggler) and U, both admitted at version 0
    buf.begin("h", "T", None, 0)
    buf.begin("h", "U", None, 0)
    version = 0
    buf.put("h", make_group("U", [0]))
    for gid in ("W", "X"):  # each step: consume, publish, admit one more, it finishes first
        assert buf.try_get_batch(1, version) is not None
        version += 1
        gov.set_version(version)
        assert gov.try_acquire("h", 1).n == 1
        buf.begin("h", gid, None, version)
        buf.put("h", make_group(gid, [version]))
    assert buf.try_get_batch(1, version) is not None
    version += 1
    buf.put("h", make_group("T", [0]))
    batch = buf.try_get_batch(1, version)
    assert batch is not None and batch.groups[0].group_id == "T"
    assert version - batch.oldest_version > 1  # stale beyond eta: the governor alone does not prevent it

    # The same schedule with admission ordering: T holds back W and X, so nothing goes stale.
    gov = StalenessGovernor(GovernorConfig(batch_size=1, max_staleness=1, max_concurrent=8))
    buf = TrajectoryBuffer(BufferConfig(max_staleness=None, order="admission"), governor=gov)
    gov.try_acquire("h", 2)
    buf.begin("h", "T", None, 0)
    buf.begin("h", "U", None, 0)
    buf.put("h", make_group("U", [0]))
    assert buf.try_get_batch(1, 0) is not None
    gov.set_version(1)
    assert gov.try_acquire("h", 1).n == 1
    buf.begin("h", "W", None, 1)
    buf.put("h", make_group("W", [1]))
    assert buf.try_get_batch(1, 1) is None  # W (admitted at 1) waits for T (admitted at 0)
    assert gov.try_acquire("h", 1).n == 0  # and the governor admits nothing more meanwhile
    buf.put("h", make_group("T", [0, 1]))
    assert [g.group_id for g in buf.try_get_batch(1, 1).groups] == ["T"]


@pytest.mark.parametrize("n_max", [1, 5])
async def test_acquire_waits_without_polling_and_wakes_on_version(n_max: int) -> None:
    gov = StalenessGovernor(GovernorConfig(batch_size=2, max_staleness=0, max_concurrent=100))
    assert gov.try_acquire("a", 10).n == 2
    waiter = asyncio.create_task(gov.acquire("b", n_max, timeout=10))
    await asyncio.sleep(0)
    assert not waiter.done() and gov.stats()["waits"] == 1
    gov.finish("a", k_accepted=2)  # accepted: capacity stays 0 until the version moves
    await asyncio.sleep(0)
    assert not waiter.done()
    gov.set_version(1)
    grant = await wait_for(waiter, 5)
    assert grant.n == min(n_max, 2) and grant.version == 1


async def test_acquire_wakes_when_a_slot_frees_and_times_out_otherwise() -> None:
    gov = StalenessGovernor(GovernorConfig(batch_size=4, max_staleness=1, max_concurrent=2))
    assert gov.try_acquire("a", 5).n == 2
    assert (await gov.acquire("b", 1, timeout=0.05)).n == 0
    assert gov.stats()["wait_timeouts"] == 1
    waiter = asyncio.create_task(gov.acquire("b", 3, timeout=10))
    await asyncio.sleep(0)
    gov.finish("a", k_rejected=1)
    assert (await wait_for(waiter, 5)).n == 1
    gov.holder_died("a")
    assert gov.running == 1 and gov.leases("b") == 1


def test_recover_resets_capacity_exactly() -> None:
    gov = StalenessGovernor(GovernorConfig(batch_size=4, max_staleness=2, max_concurrent=100))
    gov.try_acquire("a", 100)
    gov.finish("a", k_accepted=5)
    gov.recover(7)
    assert gov.running == 0 and gov.accepted == 28 and gov.version == 7
    assert gov.capacity() == (2 + 1) * 4  # neither lost (leases gone) nor inflated (accepted reset)


async def test_a_cancel_that_lands_as_the_version_moves_is_not_lost() -> None:
    """The wake-up and the cancel in one loop turn: Python 3.11's asyncio.wait_for returned the
    grant and dropped the cancel, so a rollout loop cancelled then never ended (CI hung on it)."""
    gov = StalenessGovernor(GovernorConfig(batch_size=2, max_staleness=0, max_concurrent=100))
    gov.try_acquire("a", 2)
    gov.finish("a", k_accepted=2)
    waiter = asyncio.create_task(gov.acquire("b", 1, timeout=10))
    await asyncio.sleep(0)
    gov.set_version(1)  # capacity: the waiter's wake-up is scheduled ...
    waiter.cancel()  # ... and so is its cancel
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert gov.leases("b") == 0  # nothing granted to a caller that is gone


async def test_buffer_get_batch_keeps_a_cancel_that_lands_with_a_batch() -> None:
    gov = StalenessGovernor(GovernorConfig(batch_size=1, max_staleness=0, max_concurrent=100))
    buf = TrajectoryBuffer(BufferConfig(max_staleness=0), governor=gov)
    gov.try_acquire("h", 1)
    buf.begin("h", "G", None, 0)
    getter = asyncio.create_task(buf.get_batch(1, 0, timeout=10))
    await asyncio.sleep(0)
    buf.put("h", make_group("G", [0]))
    getter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await getter
