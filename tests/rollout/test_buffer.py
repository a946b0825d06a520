"""TrajectoryBuffer: exactly-once groups, whole-group batches, waiting, dead holders' episodes."""

from __future__ import annotations

import asyncio
import random

import pytest

from nodes.plane.buffer import BufferConfig, TrajectoryBuffer, has_reward_variance
from nodes.plane.governor import GovernorConfig, StalenessGovernor
from protocols.rl import Trajectory, TrajectoryGroup
from rlactors.base.aio import wait_for


def group(gid: str, version: int = 0, n: int = 2) -> TrajectoryGroup:
    t = Trajectory([1, 2], [0, 1], [0.0, -0.1], [-1, version], 1.0, gid, 1)
    return TrajectoryGroup(gid, [t] * n)


def test_put_is_idempotent_and_groups_go_out_once() -> None:
    gov = StalenessGovernor(GovernorConfig(batch_size=2, max_staleness=1, max_concurrent=10))
    buf = TrajectoryBuffer(governor=gov)
    assert gov.try_acquire("h", 3).n == 3
    for gid in ("a", "b", "c"):
        assert buf.begin("h", gid, {"q": gid}, 0)
    assert buf.put("h", group("a"))
    assert not buf.put("h", group("a"))  # a retried put: ignored, counted, no second acceptance
    assert buf.put("h", group("b"))
    assert buf.stats()["duplicates"] == 1 and gov.accepted == 2 and gov.leases("h") == 1
    batch = buf.try_get_batch(2, 0)
    assert [g.group_id for g in batch.groups] == ["a", "b"] and len(batch.groups[0].trajectories) == 2
    assert not buf.put("h", group("a"))  # even after it was handed out
    assert buf.put("h", group("c"))
    assert buf.try_get_batch(2, 0) is None and buf.ready == 1


def test_begin_of_an_accepted_group_is_refused_and_its_lease_released() -> None:
    gov = StalenessGovernor(GovernorConfig(batch_size=1, max_staleness=4, max_concurrent=10))
    buf = TrajectoryBuffer(governor=gov)
    gov.try_acquire("h", 2)
    buf.begin("h", "a", None, 0)
    buf.put("h", group("a"))
    assert not buf.begin("h", "a", None, 0)
    assert gov.running == 0 and gov.accepted == 1


def test_begin_many_records_a_grant_and_leaves_a_refused_lease_with_the_caller() -> None:
    gov = StalenessGovernor(GovernorConfig(batch_size=1, max_staleness=4, max_concurrent=10))
    buf = TrajectoryBuffer(governor=gov, done_ids=["b"])
    gov.try_acquire("h", 3)
    assert buf.begin_many("h", [("a", {"q": 1}), ["b", None], ("c", 3)], 0) == [True, False, True]
    assert buf.in_flight == 2 and buf.stats()["refused_begin"] == 1
    assert gov.running == 3  # b's lease was not released: the caller returns that grant
    assert buf.abandon("h", "a") and not buf.abandon("h", "b")
    assert gov.running == 2


def test_begin_many_records_nothing_when_one_is_in_flight_already() -> None:
    buf = TrajectoryBuffer()
    buf.begin_many("h", [("a", None)], 0)
    with pytest.raises(ValueError, match="twice"):
        buf.begin_many("h", [("x", None), ("a", None)], 0)
    with pytest.raises(ValueError, match="twice"):
        buf.begin_many("h", [("y", None), ("y", None)], 0)
    assert buf.in_flight == 1 and buf.stats()["begun"] == 1


def test_invalid_group_is_rejected_whole() -> None:
    buf = TrajectoryBuffer()
    bad = group("a")
    bad.trajectories[0] = Trajectory([1, 2], [0, 1], [0.0], [-1, 0], 0.0, "a", 1)
    with pytest.raises(ValueError, match="logprobs"):
        buf.put("h", bad)
    assert buf.ready == 0


async def test_get_batch_waits_for_enough_groups_and_times_out() -> None:
    buf = TrajectoryBuffer()
    with pytest.raises(TimeoutError, match="0 of 2 groups"):
        await buf.get_batch(2, 0, timeout=0.05)
    waiter = asyncio.create_task(buf.get_batch(2, 0, timeout=10))
    buf.put("h", group("a"))
    await asyncio.sleep(0)
    assert not waiter.done()
    buf.put("h", group("b"))
    batch = await wait_for(waiter, 5)
    assert {g.group_id for g in batch.groups} == {"a", "b"}


def test_dead_holder_episodes_are_requeued_never_half_recorded() -> None:
    gov = StalenessGovernor(GovernorConfig(batch_size=1, max_staleness=2, max_concurrent=10))
    buf = TrajectoryBuffer(governor=gov)
    gov.try_acquire("dead", 2)
    buf.begin("dead", "a", {"q": 1}, 0)
    buf.begin("dead", "b", {"q": 2}, 0)
    buf.put("dead", group("a"))
    gov.holder_died("dead")
    orphans = buf.holder_died("dead")
    assert [o["group_id"] for o in orphans] == ["b"] and buf.in_flight == 0
    assert gov.running == 0 and gov.accepted == 1
    assert buf.take_requeued(5) == [{"group_id": "b", "item": {"q": 2}}]
    gov.try_acquire("new", 1)
    assert buf.begin("new", "b", {"q": 2}, 0)
    assert buf.put("new", group("b"))
    assert buf.ready == 2 and gov.running == 0 and gov.accepted == 2


def test_late_put_of_a_requeued_episode_wins_and_the_rerun_is_a_duplicate() -> None:
    gov = StalenessGovernor(GovernorConfig(batch_size=1, max_staleness=2, max_concurrent=10))
    buf = TrajectoryBuffer(governor=gov)
    gov.try_acquire("dead", 1)
    buf.begin("dead", "a", {"q": 1}, 0)
    buf.holder_died("dead")
    [rerun] = buf.take_requeued(1)
    gov.try_acquire("new", 1)
    buf.begin("new", rerun["group_id"], rerun["item"], 0)
    assert buf.put("dead", group("a"))  # the dead holder's put was on the wire: it is whole, keep it
    gov.holder_died("dead")
    assert not buf.put("new", group("a"))  # the re-run's result is the duplicate
    assert buf.ready == 1 and buf.in_flight == 0
    assert gov.running == 0 and gov.accepted == 1


def test_report_mode_lists_lost_episodes() -> None:
    buf = TrajectoryBuffer(BufferConfig(on_holder_death="report"))
    buf.begin("h", "a", {"q": 1}, 3)
    buf.holder_died("h")
    assert buf.lost == [{"group_id": "a", "item": {"q": 1}, "admit_version": 3}]
    assert buf.take_requeued(5) == [] and buf.stats()["reported_lost"] == 1


def test_stale_groups_are_dropped_counted_and_given_back_to_the_governor() -> None:
    gov = StalenessGovernor(GovernorConfig(batch_size=1, max_staleness=1, max_concurrent=10))
    buf = TrajectoryBuffer(BufferConfig(max_staleness=1, order="arrival"), governor=gov)
    gov.try_acquire("h", 2)
    buf.begin("h", "old", None, 0)
    buf.begin("h", "new", None, 0)
    buf.put("h", group("old", version=0))
    buf.put("h", group("new", version=2))
    assert gov.accepted == 2
    batch = buf.try_get_batch(1, 2)
    assert [g.group_id for g in batch.groups] == ["new"]
    assert buf.stats()["dropped_stale"] == 1 and gov.accepted == 1 and gov.stats()["discarded"] == 1


def _put_while_a_trainer_waits(n: int, batch_size: int) -> None:
    """Put ``n`` groups; after each, the waiting trainer wakes and asks for a batch (as get_batch does)."""
    buf = TrajectoryBuffer(BufferConfig(max_staleness=1))
    version = 0
    for i in range(n):
        buf.begin("h", f"g{i}", None, version)
        buf.put("h", group(f"g{i}", version))
        if buf.try_get_batch(batch_size, version) is not None:
            version += 1


def test_buffer_work_per_trajectory_does_not_grow_with_the_groups_waiting(monkeypatch) -> None:
    """Issue 14: every wake-up recomputed each ready group's oldest version over all its tokens, so
    a batch of N groups cost O(N^2) token scans (87% of the buffer's CPU at 1024-group batches)."""
    scans = 0
    oldest = Trajectory.oldest_version.fget

    def counted(t: Trajectory) -> int:
        nonlocal scans
        scans += 1
        return oldest(t)

    monkeypatch.setattr(Trajectory, "oldest_version", property(counted))
    for n in (64, 256):
        scans = 0
        _put_while_a_trainer_waits(n, batch_size=n)  # one big batch: every group waits for the last
        assert scans == 2 * n  # each trajectory's tokens scanned once, at its put (2 per group)
        scans = 0
        _put_while_a_trainer_waits(n, batch_size=8)
        assert scans == 2 * n


@pytest.mark.parametrize("seed", range(12))
def test_hand_out_order_and_stale_drops_match_the_rescanning_buffer(seed: int) -> None:
    """Groups kept by admission version with a heap by age hand out, hold back and drop exactly what
    the list re-sorted and re-scanned on every call did (its logic, as a reference model)."""
    rng = random.Random(seed)
    order = rng.choice(["admission", "arrival"])
    eta = rng.choice([None, 0, 1, 2])
    buf = TrajectoryBuffer(BufferConfig(max_staleness=eta, order=order))
    ready: list[tuple[int, int, str, int]] = []  # the reference: (admit, seq, gid, age), sorted
    flight: dict[str, int] = {}
    dropped = 0
    seq = 0
    for step in range(400):
        op = rng.random()
        if op < 0.4 or not flight:
            gid, v = f"g{step}", rng.randrange(0, 6)
            assert buf.begin("h", gid, None, v)
            flight[gid] = v
        elif op < 0.75:
            gid = rng.choice(sorted(flight))
            admit = flight.pop(gid)
            versions = [rng.randrange(admit, admit + 3) for _ in range(rng.randrange(0, 3))]
            t = Trajectory(
                [1, *[2] * len(versions)],
                [0] + [1] * len(versions),
                [0.0] * (len(versions) + 1),
                [-1, *versions],
                0.0,
                gid,
                1,
            )
            assert buf.put("h", TrajectoryGroup(gid, [t]))
            ready.append((admit, seq, gid, min(versions) if versions else admit))
            ready.sort()
            seq += 1
        elif op < 0.8:
            gid = rng.choice(sorted(flight))
            del flight[gid]
            assert buf.abandon("h", gid)
        else:
            b, version = rng.randrange(1, 5), rng.randrange(0, 9)
            if eta is not None:
                keep = [r for r in ready if r[3] >= version - eta]
                dropped += len(ready) - len(keep)
                ready = keep
            horizon = min(flight.values()) if flight and order == "admission" else None
            eligible = sum(1 for r in ready if horizon is None or r[0] <= horizon)
            batch = buf.try_get_batch(b, version)
            if eligible < b:
                assert batch is None
            else:
                assert [g.group_id for g in batch.groups] == [r[2] for r in ready[:b]]
                ready = ready[b:]
        assert buf.ready_group_ids() == [r[2] for r in ready]
        assert buf.stats()["dropped_stale"] == dropped


def rewarded(gid: str, rewards: list[float], version: int = 0) -> TrajectoryGroup:
    return TrajectoryGroup(
        gid, [Trajectory([1, 2], [0, 1], [0.0, -0.1], [-1, version], r, gid, 1) for r in rewards]
    )


def test_a_group_without_reward_variance_is_dropped_and_a_replacement_keeps_the_batch_full() -> None:
    """DAPO's dynamic sampling: the equal-reward group never reaches a batch, its lease goes back
    as rejected (capacity for a replacement, nothing counted accepted), and it counts as seen."""
    gov = StalenessGovernor(GovernorConfig(batch_size=2, max_staleness=0, max_concurrent=10))
    buf = TrajectoryBuffer(BufferConfig(drop_no_signal=True), governor=gov)
    assert gov.try_acquire("h", 5).n == 2  # eta 0: one batch's worth
    buf.begin("h", "a", None, 0)
    buf.begin("h", "same", None, 0)
    assert buf.put("h", rewarded("a", [1.0, 0.0]))
    assert not buf.put("h", rewarded("same", [1.0, 1.0]))
    assert buf.try_get_batch(2, 0) is None  # one short ...
    assert (gov.accepted, gov.running, gov.capacity()) == (1, 0, 1)  # ... and room for one more
    assert gov.stats()["finished_rejected"] == 1
    assert not buf.begin("h", "same", None, 0)  # seen this epoch: a replay is refused
    assert gov.try_acquire("h", 5).n == 1  # the refused begin released its lease; the replacement:
    buf.begin("h", "b", None, 0)
    assert buf.put("h", rewarded("b", [0.0, 0.5]))
    batch = buf.try_get_batch(2, 0)
    assert batch is not None and [g.group_id for g in batch.groups] == ["a", "b"]
    s = buf.stats()
    assert (s["dropped_no_signal"], s["accepted"], s["duplicates"]) == (1, 2, 0)
    assert "same" in buf.accepted_ids()  # a restarted rollout actor skips it
    assert buf.take_dropped() == ["same"] and buf.take_dropped() == []  # for the run's record, once


def test_groups_with_equal_rewards_are_trained_when_dynamic_sampling_is_off() -> None:
    gov = StalenessGovernor(GovernorConfig(batch_size=1, max_staleness=0, max_concurrent=10))
    buf = TrajectoryBuffer(governor=gov)
    assert not BufferConfig().drop_no_signal  # off by default
    gov.try_acquire("h", 1)
    buf.begin("h", "same", None, 0)
    assert buf.put("h", rewarded("same", [1.0, 1.0]))
    assert buf.try_get_batch(1, 0) is not None and buf.stats()["dropped_no_signal"] == 0


async def test_a_waiting_trainer_gets_a_full_batch_after_drops() -> None:
    gov = StalenessGovernor(GovernorConfig(batch_size=1, max_staleness=0, max_concurrent=10))
    buf = TrajectoryBuffer(BufferConfig(drop_no_signal=True), governor=gov)
    getter = asyncio.create_task(buf.get_batch(1, 0, timeout=10))
    for i, rewards in enumerate(([0.0, 0.0], [1.0, 1.0], [0.0, 1.0])):
        assert (await gov.acquire("h", 1, timeout=5)).n == 1  # each drop frees the one slot
        buf.begin("h", f"p{i}", None, 0)
        buf.put("h", rewarded(f"p{i}", rewards))
    batch = await wait_for(getter, 5)
    assert [g.group_id for g in batch.groups] == ["p2"] and buf.take_dropped() == ["p0", "p1"]


def test_a_dead_holders_late_put_without_signal_is_dropped_and_not_requeued() -> None:
    gov = StalenessGovernor(GovernorConfig(batch_size=1, max_staleness=1, max_concurrent=10))
    buf = TrajectoryBuffer(BufferConfig(drop_no_signal=True), governor=gov)
    gov.try_acquire("h", 1)
    buf.begin("h", "a", {"q": 1}, 0)
    buf.holder_died("h")  # re-queued ...
    gov.holder_died("h")
    assert not buf.put("h", rewarded("a", [2.0, 2.0]))  # ... then its put lands after all: dropped
    assert buf.take_requeued(5) == [] and gov.stats()["over_finish"] == 0
    assert buf.stats()["dropped_no_signal"] == 1 and gov.running == 0 and gov.accepted == 0


@pytest.mark.parametrize(
    ("rewards", "signal"),
    [([1.0, 1.0, 1.0], False), ([1.0, 1.0, 0.0], True), ([0.3], False), ([0.0, -0.0], False)],
)
def test_has_reward_variance(rewards: list[float], signal: bool) -> None:
    assert has_reward_variance(rewarded("g", rewards)) is signal
