"""TrajectoryBuffer: exactly-once groups, whole-group batches, waiting, dead holders' episodes."""

from __future__ import annotations

import asyncio

import pytest

from nodes.buffer import BufferConfig, TrajectoryBuffer
from nodes.governor import GovernorConfig, StalenessGovernor
from protocols.rl import Trajectory, TrajectoryGroup


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
    batch = await asyncio.wait_for(waiter, 5)
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
