"""The RL roles on three hosts (network namespaces): a reference server on h1 binds h1's address,
the trainer on h0 forms the weight-update group with it (its store on h0, from the cluster's
rendezvous) and pushes, and a rollout client on h2 generates from it and reads the new version.
Nothing here works if a server binds loopback or the group's master address is 127.0.0.1."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import rlactors
from nodes.driver.policy_sync import PolicySync
from nodes.inference.launcher import InferenceServerActor, ReferenceServerConfig, cluster_keys
from nodes.inference.models import ensure_tiny_checkpoint
from nodes.trainer.config import PushConfig, TrainConfig
from nodes.trainer.rank import TrainerRank
from rlactors.base.aio import wait_for
from tests.cluster.actors import Prober
from tests.cluster.netns import Hosts, hosts_fixture, skip_module_without_netns
from tests.cluster.test_multihost import Cluster2, _wait_nodes

pytestmark = [pytest.mark.netns, pytest.mark.slow]

skip_module_without_netns()


hosts = hosts_fixture(3)


@pytest.fixture
async def three_hosts(hosts: Hosts, tmp_path: Path) -> AsyncIterator[tuple[rlactors.Cluster, Cluster2]]:
    c = Cluster2(hosts, tmp_path)
    try:
        c.start_head()
        for i in range(3):
            c.start_agent(i)
        cluster = await rlactors.connect(c.address, secret_file=c.secret, timeout=30)
        await _wait_nodes(cluster, {"h0", "h1", "h2"})
        yield cluster, c
        await cluster.close()
    finally:
        c.stop()


async def test_push_and_generation_across_hosts(three_hosts) -> None:
    cluster, c = three_hosts
    model = str(ensure_tiny_checkpoint())
    keys = await cluster_keys(cluster)  # a server beyond loopback takes the cluster's keys
    server = await cluster.spawn(  # the keys from the driver: a worker may not read secret keys
        InferenceServerActor, ReferenceServerConfig(model_path=model, backend="sim"), keys=keys, node_id="h1"
    )
    url = await wait_for(server.url(), 120)
    assert url.startswith(f"http://{c.hosts.ip(1)}:")  # the node's address, not loopback
    # the config dataclass goes through the head and h0's agent (daemons that never import it)
    cfg = TrainConfig(model_path=model, push=PushConfig(pause_mode=None, keys=keys))
    rank = await cluster.spawn(TrainerRank, cfg, node_id="h0")
    await cluster.collective_group([rank], backend="gloo", timeout=60)
    await rank.setup()
    sync = PolicySync(cluster, rlactors.ActorGroup([rank]), [url], keys=keys)
    await wait_for(sync.connect(), 120)
    await wait_for(rank.push_weights(), 120)
    prober = await cluster.spawn(Prober, node_id="h2")
    out = await wait_for(prober.generate([url], 0, (keys.api_key, keys.admin_api_key)), 60)
    assert len(out["ids"]) == 8
    # the tokens came from the weights the trainer pushed (version 0 -> server labels them "0")
    assert out["versions"] == [0] * 8
    await sync.aclose()
