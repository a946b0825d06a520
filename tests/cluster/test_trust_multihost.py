"""The split credential across hosts (network namespaces): a worker on one host cannot have a
process started on another; an actor spawned with control=True can."""

from __future__ import annotations

import pytest

from rlactors.base.aio import wait_for
from tests.cluster.test_multihost import hosts, two_hosts  # noqa: F401 (fixtures)
from tests.cluster.test_trust import Spawner
from tests.runtime.actors import Counter

pytestmark = pytest.mark.netns


async def test_a_worker_on_one_host_cannot_start_a_process_on_another(two_hosts) -> None:  # noqa: F811
    cluster, _ = two_hosts
    there = await cluster.spawn(Counter, 1, node_id="h1")
    worker = await cluster.spawn(Spawner, node_id="h0")
    assert await worker.call(there, 1) == 2  # it calls an actor on the other host
    with pytest.raises(PermissionError, match="control credential"):
        await wait_for(worker.spawn_counter(0, "h1"), 30)
    assert sum(a["class_name"] == "Counter" for a in await cluster.actors()) == 1
    boss = await cluster.spawn(Spawner, node_id="h0", control=True)
    assert await wait_for(boss.spawn_counter(9, "h1"), 60) == 10
