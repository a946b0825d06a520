"""Calls to a group of actors in real worker processes: results in order, arguments encoded once,
and the failure rules of a collective (the dead member's error first, a grace, then cancellation)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

import rlactors
from rlactors.base.aio import wait_for
from tests.runtime.actors import Counted, Counter, Member


async def members(cluster, n: int, grace_s: float | None = 60.0) -> rlactors.ActorGroup:
    return rlactors.ActorGroup(
        await asyncio.gather(*(cluster.spawn(Member, i) for i in range(n))), grace_s=grace_s
    )


async def test_a_group_call_returns_every_members_result_in_order(cluster) -> None:
    group = rlactors.ActorGroup([await cluster.spawn(Counter, start) for start in (30, 10, 20)])
    assert await group.add(1) == [31, 11, 21]
    assert await group.add.scatter([(1,), (2,), (3,)]) == [32, 13, 24]
    group.add.tell(100)
    assert await group.value() == [132, 113, 124]  # the tells arrived before this call
    assert await rlactors.ActorGroup([]).value() == []


async def test_arguments_sent_to_every_member_are_encoded_once(cluster) -> None:
    group = await members(cluster, 3)
    payload = np.arange(100_000, dtype=np.float64)  # travels as a raw frame, shared by the three calls
    before = Counted.encoded
    totals = await group.total(Counted(payload))
    assert Counted.encoded - before == 1
    assert totals == [payload.sum(), payload.sum() + 1, payload.sum() + 2]
    group.total.tell(Counted(payload))
    assert Counted.encoded - before == 2
    await group[0].total(Counted(payload))  # a plain call encodes its own
    assert Counted.encoded - before == 3


async def test_a_dead_member_is_the_error_and_blocked_peers_are_cancelled_after_the_grace(cluster) -> None:
    group = await members(cluster, 3, grace_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(rlactors.ActorDiedError):
        await wait_for(group.act([["die", 0], ["ok", 3600], ["ok", 3600]]), 30)
    assert time.monotonic() - t0 < 20
    assert await group[1].was_cancelled() and await group[2].was_cancelled()
    assert await group[1].finished_calls() == 0


async def test_the_dead_members_error_is_preferred_over_its_peers_transport_errors(cluster) -> None:
    # The peers fail first, as in a collective whose member died; the death is reported a little
    # later, within the grace, and is the error raised.
    group = await members(cluster, 3, grace_s=30)
    t0 = time.monotonic()
    with pytest.raises(rlactors.ActorDiedError):
        await wait_for(group.act([["raise", 0], ["die", 0.3], ["raise", 0]]), 30)
    assert time.monotonic() - t0 < 20  # the grace ends when every member has answered


async def test_after_a_failure_the_other_members_finish_within_the_grace(cluster) -> None:
    group = await members(cluster, 2)
    with pytest.raises(ConnectionError, match="rank 0"):
        await wait_for(group.act([["raise", 0], ["ok", 0.5]]), 30)
    # The call returned only once rank 1 had finished: a retry cannot meet it still in the old call.
    assert await group[1].finished_calls() == 1
    assert await group.act([["ok", 0], ["ok", 0]]) == [0, 1]


async def test_cancelling_the_caller_cancels_every_members_call(cluster) -> None:
    group = await members(cluster, 3)
    call = asyncio.ensure_future(group.act([["ok", 3600]] * 3))
    assert await asyncio.gather(*(m.wait_started() for m in group)) == [True] * 3
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert await asyncio.gather(*(m.was_cancelled() for m in group)) == [True] * 3


async def test_scatter_follows_the_same_failure_rules(cluster) -> None:
    group = await members(cluster, 2, grace_s=0.5)
    plan = [["ok", 3600], ["die", 0]]
    with pytest.raises(rlactors.ActorDiedError):
        await wait_for(group.act.scatter([(plan,), (plan,)]), 30)
    assert await group[0].was_cancelled()
