"""The culprit first, on real processes: two "trainer" ranks in a gloo collective, the driver calling
both as an ActorGroup. A rank stopped with SIGSTOP mid-step, and a rank that raises while its peer
waits in the collective, each head ``cluster.stacks()`` and the stall watchdog's line names them,
though the rollout waits on the governor under its staleness bound all the while."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import rlactors
from nodes.driver.watchdog import StallWatchdog
from rlactors.api.stacks import StacksReport
from rlactors.base.aio import wait_for


class Rank(rlactors.Actor):
    """A trainer rank in miniature: ``step`` is a sync method with one all_reduce."""

    def step(self, raise_first: bool = False) -> float:
        import torch
        import torch.distributed as dist

        if raise_first:
            raise ValueError("this rank raised before its all_reduce")
        t = torch.ones(1)
        dist.all_reduce(t)
        return float(t)

    async def pid(self) -> int:
        return os.getpid()


class Governor(rlactors.Actor):
    """Holds its caller back, by design, until released."""

    def __init__(self) -> None:
        self.free = asyncio.Event()

    @rlactors.backpressure("rollout held under the staleness bound")
    async def acquire(self) -> int:
        await self.free.wait()
        return 1

    async def stats(self) -> dict[str, Any]:
        return {"capacity": 0}


class Rollout(rlactors.Actor):
    async def run(self, governor: Any) -> int:
        return await governor.acquire()


async def culprit_when(cluster: rlactors.Cluster, name: str, within: float = 60.0) -> StacksReport:
    """The report once its culprit is ``name``, trainer-0 is seen in its collective and the
    governor holds the rollout's call (a call still on the wire is not seen there yet)."""
    deadline = time.monotonic() + within
    while True:
        report = await cluster.stacks(timeout_s=3.0)
        c = report.culprit
        held = any(e.target == "governor" and e.backpressure for e in report.edges)
        if c is not None and c.name == name and "all_reduce" in report["trainer-0"].collective_wait and held:
            return report
        assert time.monotonic() < deadline, str(report)


async def start(cluster: rlactors.Cluster) -> tuple[rlactors.ActorGroup[Rank], Any]:
    ranks = await cluster.spawn_group(Rank, 2, name="trainer")
    await cluster.collective_group(list(ranks), "gloo", timeout=120)
    governor = await cluster.spawn(Governor, name="governor")
    rollout = await cluster.spawn(Rollout, name="rollout-0")
    return ranks, rollout.run.submit(governor)


async def stall_line(cluster: rlactors.Cluster, out: Path) -> str:
    """What the recipe's watchdog prints for this cluster (no servers, no episodes in flight)."""

    async def answer(value: Any = None) -> Any:
        return value

    plane = SimpleNamespace(
        cluster=cluster,
        sync=SimpleNamespace(live=[]),
        governor=SimpleNamespace(stats=lambda: answer({"capacity": 0})),
        buffer=SimpleNamespace(stats=lambda: answer({}), oldest_in_flight=lambda: answer(None)),
        rollouts=[],
    )
    lines: list[str] = []
    wd = StallWatchdog(plane, out, 1.0, report=lines.append, command=f"rlactors stack --run {out}")
    line, path = await wd.diagnose(5, 13.0)
    assert lines == [line] and "CULPRIT" in path.read_text()
    return line


async def stack_from_outside(run_dir: Path, waits: str, within: float = 60.0) -> str:
    """``rlactors stack --run RUN_DIR`` from another process, once a line starts with ``waits``
    (the driver's calls reach the head with its heartbeats)."""
    deadline = time.monotonic() + within
    while True:
        r = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "rlactors.launch.cli", "stack", "--run", str(run_dir)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        if any(line.startswith(waits) for line in r.stdout.splitlines()) or time.monotonic() > deadline:
            return r.stdout


async def test_a_rank_stopped_mid_step_is_named_first(tmp_path: Path) -> None:
    async with rlactors.init() as cluster:
        ranks, held = await start(cluster)
        pid = await ranks[1].pid()
        os.kill(pid, signal.SIGSTOP)
        step = asyncio.ensure_future(ranks.step())
        try:
            report = await culprit_when(cluster, "trainer-1")
            assert report.culprit.kind == "unresponsive", str(report)
            assert "not in it: trainer-1 is unresponsive" in report["trainer-0"].collective_wait
            # the rollout's wait is there, labelled, and last
            assert report.waited_on[-1].name == "governor" and report.waited_on[-1].kind == "backpressure"
            assert str(report).split("\n")[2].startswith("CULPRIT (unresponsive): trainer-1 at the end of ")
            line = await stall_line(cluster, tmp_path)
            assert line.startswith("stall: step 5 has run for 13 s, waiting on trainer-1 (unresponsive"), line
            assert line.endswith(f"stacks now: rlactors stack --run {tmp_path}"), line
            # the operator's command, from another process: the driver's calls are there too (as
            # of its last heartbeat), and the culprit heads it
            assert cluster.record_run(tmp_path) == f"--run {tmp_path}"
            text = await stack_from_outside(tmp_path, "driver-")
            assert text.split("\n")[2].startswith(
                "CULPRIT (unresponsive): trainer-1 at the end of driver-"
            ), text
            assert "waits on trainer-1.step" in text, text
        finally:
            os.kill(pid, signal.SIGCONT)
        # woken, the rank joins the collective and the step completes (unless its call was failed
        # as unreachable meanwhile: then the group call says so)
        try:
            assert await wait_for(step, 60) == [2.0, 2.0]
        except rlactors.ActorUnreachableError:
            pass
        held.cancel()


async def test_a_rank_that_raises_while_its_peer_waits_in_the_collective_is_named(tmp_path: Path) -> None:
    async with rlactors.init() as cluster:
        ranks, held = await start(cluster)
        step = asyncio.ensure_future(ranks.step.scatter([(False,), (True,)]))
        try:
            report = await culprit_when(cluster, "trainer-1")
            assert report.culprit.kind == "failed", str(report)
            assert "ValueError: this rank raised before its all_reduce" in report.culprit.summary
            assert "not in it: trainer-1 is elsewhere: idle" in report["trainer-0"].collective_wait
            line = await stall_line(cluster, tmp_path)
            assert line.startswith(
                "stall: step 5 has run for 13 s, waiting on trainer-1 (idle; its step failed"
            ), line
        finally:
            step.cancel()
            held.cancel()
            for r in ranks:  # trainer-0 stays in its all_reduce until gloo's timeout: end it now
                await cluster.kill(r)
