"""Checkpoints of trainer ranks on two hosts (network namespaces; each host's agent also runs in its
own mount namespace, so one path can be a different disk on each host). Under one run folder:

- ``shared``: the same folder for the test (the driver) and both hosts: a save succeeds, resumes;
- ``local``: host h1 has a disk of its own there (h0 shares the driver's): the save fails, naming
  the path and the hosts, before anything is written; no ``latest``;
- ``trainers``: one disk for both trainer hosts that the driver does not see: the ranks save, and
  the driver refuses to point ``latest`` at a checkpoint it could not resume from.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import rlactors
from nodes.driver.run_state import RunState
from nodes.inference.models import ensure_tiny_checkpoint
from nodes.trainer.config import TrainConfig
from nodes.trainer.manifest import CheckpointError
from nodes.trainer.rank import TrainerRank
from rlactors.base.aio import wait_for
from tests.cluster.netns import Hosts, hosts_fixture, skip_module_without_netns
from tests.cluster.test_multihost import Cluster2, _wait_nodes
from tests.helpers.synthetic import synthetic_batch, with_advantages

pytestmark = [pytest.mark.netns, pytest.mark.slow]
CALL = 120  # seconds: bounds each call, so a collective that waits on a failed rank fails the test


def _mount_namespaces_unavailable() -> str | None:
    if shutil.which("unshare") is None:
        return "util-linux 'unshare' is not installed"
    r = subprocess.run(["unshare", "--mount", "true"], capture_output=True, text=True)
    return f"unshare --mount failed: {r.stderr.strip()}" if r.returncode else None


skip_module_without_netns(_mount_namespaces_unavailable())


hosts = hosts_fixture(2)


class DiskHosts(Cluster2):
    """Cluster2 whose agent on host ``i`` (and so its workers) sees ``mounts[i]``: ``(disk, at)``
    pairs, the folder ``disk`` bind-mounted at ``at`` in a mount namespace of its own."""

    def __init__(self, hosts: Hosts, tmp: Path, mounts: list[list[tuple[Path, Path]]]) -> None:
        super().__init__(hosts, tmp)
        self.mounts = mounts

    def _popen(self, cmd: list[str], name: str) -> subprocess.Popen[bytes]:
        if name.startswith("agent-h"):  # cmd: ip netns exec <ns> python -m rlactors.launch.daemons agent ...
            binds = [
                f"mount --bind {shlex.quote(str(d))} {shlex.quote(str(at))}"
                for d, at in self.mounts[int(name[7:])]
            ]
            script = "set -e; " + "; ".join(binds) + '; exec "$@"'
            cmd = [
                *cmd[:4],
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                script,
                "sh",
                *cmd[4:],
            ]
        return super()._popen(cmd, name)


@pytest.fixture
async def disk_hosts(hosts: Hosts, tmp_path: Path) -> AsyncIterator[tuple[rlactors.Cluster, Path]]:
    runs = tmp_path / "runs"
    for d in ("runs/shared", "runs/local", "runs/trainers", "disk-h1", "disk-trainers"):
        (tmp_path / d).mkdir(parents=True)
    mounts = [
        [(tmp_path / "disk-trainers", runs / "trainers")],
        [(tmp_path / "disk-h1", runs / "local"), (tmp_path / "disk-trainers", runs / "trainers")],
    ]
    c = DiskHosts(hosts, tmp_path, mounts)
    try:
        c.start_head()
        c.start_agent(0)
        c.start_agent(1)
        cluster = await rlactors.connect(c.address, secret_file=c.secret, timeout=30)
        await _wait_nodes(cluster, {"h0", "h1"})
        yield cluster, tmp_path
        await cluster.close()
    finally:
        c.stop()


def _saved_at_step(out: Path, step: int, version: int) -> RunState:
    state = RunState(out)
    state.step, state.version = step, version  # as RunState.record leaves them after a step
    return state


async def test_a_checkpoint_is_saved_whole_on_a_shared_disk_or_refused_naming_the_hosts(disk_hosts) -> None:
    cluster, tmp = disk_hosts
    runs = tmp / "runs"
    cfg = TrainConfig(model_path=str(ensure_tiny_checkpoint()), max_tokens_per_mb=64)
    ranks = rlactors.ActorGroup(
        [
            await cluster.spawn(TrainerRank, cfg, node_id=f"h{i}", env={"OMP_NUM_THREADS": "1"})
            for i in range(2)
        ]
    )
    await cluster.collective_group(list(ranks), backend="gloo", timeout=CALL)
    assert [i["rank"] for i in await wait_for(ranks.setup(), CALL)] == [0, 1]
    batch = with_advantages(synthetic_batch(4, 2, seed=3, max_lag=0))
    await wait_for(ranks.train_step(batch), CALL)  # policy version 1

    # h1 has its own disk at the path: refused before anything is written, on every rank (without
    # the check, rank 0 would write a manifest listing rank 1's files and --resume would fail).
    local = _saved_at_step(runs / "local" / "run", 1, 1)
    with pytest.raises(CheckpointError) as refused:
        await wait_for(local.save(ranks), CALL)
    path = runs / "local" / "run" / "checkpoints" / "step-1"
    assert re.match(
        rf"cannot save checkpoint {re.escape(str(path))}: rank 0 on node h0 \(.*\) does not see the "
        r"files written to that path by rank 1 on node h1 \(",
        str(refused.value),
    ), refused.value
    assert list(local.checkpoints.iterdir()) == []  # step-1.tmp removed, no latest
    assert list((tmp / "disk-h1").iterdir()) == [] and local.saved_step is None  # nothing on h1's disk

    # The trainer hosts share a disk the driver does not see: saved there, but `latest` is not moved.
    trainers = _saved_at_step(runs / "trainers" / "run", 1, 1)
    with pytest.raises(CheckpointError, match=r"step-1 was saved by the trainer ranks, but this process"):
        await wait_for(trainers.save(ranks), CALL)
    assert (tmp / "disk-trainers" / "run" / "checkpoints" / "step-1" / "manifest.json").is_file()
    assert not (trainers.checkpoints / "latest").exists()

    # One disk for everyone: saved, and a later run resumes from it.
    shared = _saved_at_step(runs / "shared" / "run", 1, 1)
    assert await wait_for(shared.save(ranks), CALL) == shared.checkpoints / "step-1"
    assert (shared.checkpoints / "latest").read_text() == "1\n"
    assert sorted(p.name for p in shared.checkpoints.iterdir()) == ["latest", "step-1"]
    await wait_for(ranks.train_step(batch), CALL)
    assert await ranks[1].version() == 2
    shared._lock.close()  # that run has ended: its folder is free for the next one
    resumed = RunState(runs / "shared" / "run", resume=True)
    assert resumed.resume_from == 1
    assert (await wait_for(resumed.load(ranks), CALL)).startswith("resumed from step 1 (policy version 1;")
    assert [await r.version() for r in ranks] == [1, 1]
    await ranks.close()
