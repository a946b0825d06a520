"""cluster.stacks(): who waits on whom, from every worker's loop; a wait cycle named; a sync method's
frame; a stuck loop reported unresponsive with its dumped stacks; a dead actor reported dead; a
dump that leaves the dumped process alive while its other threads run."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

import rlactors
from rlactors.api.stacks import (
    ActorStacks,
    IncomingCall,
    NotedWait,
    OutgoingCall,
    StacksReport,
    WaitEdge,
    build_report,
    dump_loop_thread,
)
from rlactors.base import forensics
from rlactors.base.aio import wait_for


class Ping(rlactors.Actor):
    """Spawned with max_concurrency=1: ``f`` calls the peer, whose ``g`` calls back ``h``, which
    queues behind ``f``."""

    def __init__(self) -> None:
        self.peer: Any = None

    async def set_peer(self, peer: Any) -> None:
        self.peer = peer

    async def f(self) -> str:
        return await self.peer.g()

    async def h(self) -> str:
        return "h"


class Pong(rlactors.Actor):
    def __init__(self, peer: Any) -> None:
        self.peer = peer

    async def g(self) -> str:
        return await self.peer.h()


class Busy(rlactors.Actor):
    def nap_in_thread(self, seconds: float) -> None:
        time.sleep(seconds)

    async def spin_on_the_loop(self, seconds: float) -> None:
        t = time.time() + seconds
        while time.time() < t:
            pass

    async def ping(self) -> str:
        return "pong"


@pytest.fixture
async def cluster() -> AsyncIterator[rlactors.Cluster]:
    async with rlactors.init() as c:
        yield c


async def report_when(
    cluster: rlactors.Cluster, ok: Callable[[StacksReport], bool], within: float, **kw: Any
) -> StacksReport:
    """Ask for the report until ``ok`` holds; fail with the last one after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        report = await cluster.stacks(**kw)
        if ok(report) or time.monotonic() > deadline:
            assert ok(report), str(report)
            return report


async def start_cycle(cluster: rlactors.Cluster, a: str = "fa", b: str = "fb", **kw: Any) -> Any:
    pa = await cluster.spawn(Ping, name=a, max_concurrency=1, **kw)
    pb = await cluster.spawn(Pong, pa, name=b, **kw)
    await pa.set_peer(pb)
    return pa


async def test_a_wait_cycle_is_named_within_5_s(cluster: rlactors.Cluster) -> None:
    pa = await start_cycle(cluster)
    stuck = pa.f.submit()
    try:
        t0 = time.monotonic()
        # (a call still on the wire shows "not seen there" for a moment)
        report = await report_when(
            cluster, lambda r: bool(r.cycles) and all(e.state != "unseen" for e in r.edges), within=5.0
        )
        assert time.monotonic() - t0 < 5.0
        (cycle,) = report.cycles
        assert sorted(cycle.actors) == ["fa", "fb"]
        text = str(cycle)
        assert "fa.f waits on fb.g (running there" in text, text
        assert "fb.g waits on fa.h (queued there" in text, text
        # the queued call is behind fa's max_concurrency=1; the driver's call roots the chain
        fa = report["fa"]
        assert [c.method for c in fa.queued] == ["h"] and fa.max_concurrency == 1
        assert {c.method: c.caller for c in fa.incoming}["h"] == "fb.g"
        assert any(a.state == "DRIVER" and a.outgoing[0].method == "f" for a in report.actors)
        longest = report.waited_on[0]
        assert longest.chain[1:] == ["fa", "fb"] and longest.chain[0].startswith("driver-")
        assert longest.summary.startswith("fb at the end of driver-")
        # fb's await chain reaches its call to fa
        (g,) = report["fb"].incoming
        assert any("in g" in line for line in g.stack) and "awaiting" in g.stack[-1]
        assert "WAIT CYCLES" in str(report) and "behind max_concurrency=1" in str(report)
    finally:
        stuck.cancel()


async def test_a_sync_method_shows_its_frame(cluster: rlactors.Cluster) -> None:
    busy = await cluster.spawn(Busy, name="napper")
    napping = busy.nap_in_thread.submit(60)

    def napping_shown(r: StacksReport) -> bool:
        calls = r["napper"].running
        return bool(calls) and any("in nap_in_thread" in line for line in calls[0].stack)

    report = await report_when(cluster, napping_shown, within=5.0, names=["napper"])
    (call,) = report["napper"].running
    assert call.thread and "time.sleep(seconds)" in "\n".join(call.stack)
    assert "nap_in_thread" in report["napper"].summary()
    assert any("-sync" in name for name in report["napper"].threads)  # the worker thread, by name
    napping.cancel()


async def test_a_stuck_loop_is_reported_unresponsive_with_its_stack(cluster: rlactors.Cluster) -> None:
    busy = await cluster.spawn(Busy, name="spinner")
    await busy.ping()
    spinning = busy.spin_on_the_loop.submit(60)
    # On a loaded machine a starved idle loop may also miss the answer's deadline: wait for a
    # report whose dump holds the spin (in whichever thread took the signal), then the summary
    # must name it from the loop's own thread.
    report = await report_when(
        cluster,
        lambda r: not r["spinner"].responsive and "spin_on_the_loop" in (r["spinner"].dump or ""),
        within=30.0,
        names=["spinner"],
        timeout_s=3.0,
    )
    spinner = report["spinner"]
    assert spinner.loop_thread is not None
    summary = spinner.summary()
    assert summary.startswith("unresponsive for ") and "spin_on_the_loop" in summary, summary
    await cluster.kill(busy)
    with pytest.raises(rlactors.ActorDiedError):
        await spinning


async def test_a_dead_actor_is_reported_dead(cluster: rlactors.Cluster) -> None:
    gone = await cluster.spawn(Busy, name="gone")
    alive = await cluster.spawn(Busy, name="alive")
    await cluster.kill(gone)
    report = await cluster.stacks(["gone", "alive", "never-was"], timeout_s=2.0)
    assert report["gone"].state == "DEAD" and report["gone"].summary().startswith("dead: ")
    assert report["alive"].responsive and report["alive"].summary() == "idle"
    assert report["never-was"].state == "UNKNOWN"
    assert report.taken_s < 3.0
    await alive.ping()


async def test_a_call_to_a_dead_actor_ends_a_chain_there() -> None:
    # the graph alone, without processes: a driver waits on a, a on b, which is dead
    a = ActorStacks("a", "ida", "ALIVE", outgoing=[OutgoingCall("b", "idb", "g", 2.0, "f", 7)])
    b = ActorStacks("b", "idb", "DEAD", reason="worker process killed by SIGKILL")
    driver = ActorStacks.driver(
        "driver-1", [{"actor_id": "ida", "name": "a", "method": "f", "age_s": 3.0, "call_id": 1}]
    )
    report = build_report([a, b, driver])
    assert not report.cycles
    (end,) = report.waited_on
    assert end.name == "b" and end.chain == ["driver-1", "a", "b"]
    assert end.summary == "b at the end of driver-1 → a → b: dead: worker process killed by SIGKILL"
    assert str(report.edges[-1]) == str(WaitEdge("a", "b", "g", 2.0, "f", "unseen"))
    assert "a.f waits on b.g (not seen there, 2.0 s)" in str(report)


def _other_driver(noted_s: float, *calls: tuple[str, str, str, float]) -> ActorStacks:
    """A driver of another process, as the head reports it: its calls as its loop noted them
    ``noted_s`` ago (it notes them every 2 s while its loop runs)."""
    outgoing = [
        {"actor_id": i, "name": n, "method": m, "age_s": age, "call_id": k}
        for k, (i, n, m, age) in enumerate(calls)
    ]
    return ActorStacks.from_answer(
        {
            "name": "driver-2",
            "actor_id": "driver-2",
            "state": "DRIVER",
            "outgoing": outgoing,
            "noted_s": noted_s,
            "note_interval_s": 2.0,
        }
    )


def test_a_call_another_drivers_view_holds_and_its_target_does_not_is_no_culprit() -> None:
    # rlactors stack from another process: the driver's last note (3.3 s ago) holds pool.start,
    # which the pool, alive and answering, no longer runs: its reply came after the note
    pool = ActorStacks("pool", "idp", "ALIVE")
    report = build_report([pool, _other_driver(3.3, ("idp", "pool", "start", 5.0))])
    assert report.culprit is None and not report.waited_on, str(report)
    text = str(report)
    assert "CULPRIT" not in text
    assert "driver-2 waits on pool.start (not seen there; as the driver saw it 3.3 s ago: its reply" in text
    assert "driver-2 (calls as of 3.3 s ago): waiting on pool.start for 5.0 s" in text
    # while the pool still runs it, the pool is where the chain ends, whatever the view's age
    pool.incoming.append(IncomingCall("start", 5.0, "running", ['File "pool.py", line 1, in start'], 0))
    report = build_report([pool, _other_driver(3.3, ("idp", "pool", "start", 5.0))])
    assert report.culprit is not None and report.culprit.name == "pool", str(report)
    # a dead target did not answer, old view or not: it is the culprit
    dead = ActorStacks("pool", "idp", "DEAD", reason="worker process killed by SIGKILL")
    report = build_report([dead, _other_driver(3.3, ("idp", "pool", "start", 5.0))])
    assert report.culprit is not None and report.culprit.kind == "dead", str(report)


def test_a_driver_whose_loop_stopped_noting_its_calls_is_reported_blocked() -> None:
    pool = ActorStacks("pool", "idp", "ALIVE")
    fresh = _other_driver(3.9, ("idp", "pool", "start", 5.0))  # within two notes: its loop runs
    assert fresh.loop_blocked_s is None and fresh.summary() == "waiting on pool.start for 5.0 s"
    blocked = _other_driver(30.0, ("idp", "pool", "start", 31.0))
    assert blocked.loop_blocked_s == 28.0
    assert blocked.summary() == (
        "its event loop has not run for about 28.0 s (synchronous code in the driver, or the process "
        "stopped); as of then, waiting on pool.start"
    )
    assert build_report([pool, blocked]).culprit is None


async def test_the_report_is_bounded_when_a_worker_answers_nothing(cluster: rlactors.Cluster) -> None:
    # a stopped process neither answers nor dumps: reported, not waited for
    busy = await cluster.spawn(Busy, name="stopped")
    (pid,) = [a["pid"] for a in await cluster.actors() if a["name"] == "stopped"]
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        report = await cluster.stacks(timeout_s=2.0)
        assert time.monotonic() - t0 < 4.0
        assert not report["stopped"].responsive
    finally:
        os.kill(pid, signal.SIGCONT)
    assert await wait_for(busy.ping(), 10) == "pong"


LOOP, OTHER = 0x00007F2B5F9E2B80, 0x00007F2B5ECC46C0
DUMP = f"""Current thread 0x{OTHER:016x} (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/usr/lib/python3.11/concurrent/futures/thread.py", line 81 in _worker

Thread 0x{LOOP:016x} (most recent call first):
  File "/app/tests/runtime/test_forensics.py", line 51 in spin_on_the_loop
  File "/usr/lib/python3.11/asyncio/events.py", line 84 in _run
  File "/usr/lib/python3.11/asyncio/runners.py", line 118 in run
"""


def test_a_dumped_loop_is_read_from_the_loop_thread_whichever_thread_took_the_signal() -> None:
    assert dump_loop_thread(DUMP, LOOP)[-1].endswith("in spin_on_the_loop")
    one_thread = DUMP.split("\n\n")[1].replace(f"Thread 0x{LOOP:016x}", "Stack")  # the fallback's
    assert dump_loop_thread(one_thread, LOOP)[-1].endswith("in spin_on_the_loop")
    a = ActorStacks(
        "spinner", "id", "ALIVE", responsive=False, unresponsive_s=2.0, dump=DUMP, loop_thread=LOOP
    )
    assert "its loop is stuck in spin_on_the_loop (test_forensics.py:51)" in a.summary()
    a.loop_thread = None  # an older worker: the thread that took the signal
    assert "spin_on_the_loop" not in a.summary()


def _driver(*calls: tuple[str, str, str, float]) -> ActorStacks:
    return ActorStacks.driver(
        "driver-1",
        [
            {"actor_id": i, "name": n, "method": m, "age_s": age, "call_id": k}
            for k, (i, n, m, age) in enumerate(calls)
        ],
    )


ALL_REDUCE = [
    'File "/app/nodes/trainer/rank.py", line 70, in train_step',
    'File "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 79, in wrapper',
    'File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2501, in all_reduce',
]
GROUP = {
    "group": "default",
    "backend": "gloo",
    "world_size": 2,
    "members": [["t0", "trainer-0"], ["t1", "trainer-1"]],
}


def _rank0() -> ActorStacks:
    return ActorStacks(
        "trainer-0",
        "t0",
        "ALIVE",
        collective=dict(GROUP, rank=0),
        incoming=[IncomingCall("train_step", 30.0, "running", ALL_REDUCE, 0, thread=True)],
    )


def _rollout_held_back() -> list[ActorStacks]:
    governor = ActorStacks(
        "governor",
        "g",
        "ALIVE",
        incoming=[IncomingCall("acquire", 40.0, "running", [], 3, backpressure="under the staleness bound")],
    )
    rollout = ActorStacks(
        "rollout-0", "r", "ALIVE", outgoing=[OutgoingCall("governor", "g", "acquire", 40.0, "run", 3)]
    )
    return [governor, rollout]


def test_a_stopped_rank_heads_the_report_over_back_pressure_and_its_peer_names_it() -> None:
    stopped = ActorStacks("trainer-1", "t1", "ALIVE", responsive=False, unresponsive_s=28.5)
    driver = _driver(("t0", "trainer-0", "train_step", 30.0), ("t1", "trainer-1", "train_step", 30.0))
    report = build_report([_rank0(), stopped, driver, *_rollout_held_back()])
    culprit = report.culprit
    assert culprit is not None and culprit.name == "trainer-1" and culprit.kind == "unresponsive"
    assert report.waited_on[0] is culprit and report.waited_on[-1].name == "governor"
    assert report.waited_on[-1].kind == "backpressure"
    assert culprit.chain == ["driver-1", "trainer-0", "trainer-1"]
    assert "trainer-0 waits for it in all_reduce" in culprit.summary
    rank0 = report["trainer-0"].summary()
    assert (
        "blocked in all_reduce (distributed_c10d.py:2501), a collective of group 'default' (gloo, rank 0 of 2)"
        in rank0
    )
    assert "not in it: trainer-1 is unresponsive for 28.5 s" in rank0
    text = str(report)
    assert text.split("\n")[2].startswith("CULPRIT (unresponsive): trainer-1 at the end of driver-1"), text
    assert "back-pressure by design: under the staleness bound" in text


def test_a_rank_whose_call_failed_while_its_peer_waits_in_the_collective_is_the_culprit() -> None:
    raised = ActorStacks("trainer-1", "t1", "ALIVE", collective=dict(GROUP, rank=1))  # idle: it returned
    driver = _driver(("t0", "trainer-0", "train_step", 30.0))
    driver.outgoing.append(
        OutgoingCall("trainer-1", "t1", "train_step", 30.0, None, 0, failed="RemoteError: ValueError: boom")
    )
    report = build_report([_rank0(), raised, driver, *_rollout_held_back()])
    culprit = report.culprit
    assert culprit is not None and (culprit.name, culprit.kind) == ("trainer-1", "failed")
    assert "its train_step failed (RemoteError: ValueError: boom)" in culprit.summary
    assert "not in it: trainer-1 is elsewhere: idle" in report["trainer-0"].summary()
    assert "driver-1 waits on trainer-1.train_step (failed there: RemoteError" in str(report)


def test_back_pressure_alone_names_no_culprit() -> None:
    report = build_report(_rollout_held_back())
    assert report.culprit is None and [w.kind for w in report.waited_on] == ["backpressure"]
    assert "(back-pressure by design)" in report.waited_on[0].summary


def _push_in_progress() -> list[ActorStacks]:
    """The driver pushes weights through trainer-0 while rollout-0 holds its requests."""
    rollout = ActorStacks(
        "rollout-0",
        "r",
        "ALIVE",
        waits=[
            NotedWait(
                "dispatch paused",
                "the weight push",
                12.0,
                3,
                None,
                "requests held while the trainer pushes weights",
            )
        ],
    )
    trainer = ActorStacks(
        "trainer-0", "t0", "ALIVE", incoming=[IncomingCall("push_weights", 12.0, "running", [], 0)]
    )
    return [rollout, trainer, _driver(("t0", "trainer-0", "push_weights", 12.0))]


def test_a_paused_dispatch_during_a_push_is_back_pressure_never_the_culprit() -> None:
    report = build_report(_push_in_progress())
    culprit = report.culprit
    assert culprit is not None and (culprit.name, culprit.kind) == ("trainer-0", "busy")
    push = report.waited_on[-1]
    assert (push.name, push.kind, push.chain) == (
        "the weight push",
        "backpressure",
        ["rollout-0", "the weight push"],
    )
    assert (
        "rollout-0: dispatch paused (3 waits)" in push.summary and "(back-pressure by design)" in push.summary
    )
    text = str(report)
    assert text.split("\n")[2].startswith("CULPRIT (busy): trainer-0"), text
    assert (
        "rollout-0 waits on the weight push: dispatch paused (3 waits, no actor call, back-pressure by design:"
        " requests held while the trainer pushes weights, 12.0 s)" in text
    ), text
    assert (
        "dispatch paused (3 waits) on the weight push for 12.0 s, back-pressure by design"
        in report["rollout-0"].summary()
    )
    alone = build_report(_push_in_progress()[:1])  # nothing else waits: no culprit at all
    assert alone.culprit is None and [w.kind for w in alone.waited_on] == ["backpressure"]


def test_a_noted_wait_that_is_not_by_design_is_busy_not_dead() -> None:
    waiter = ActorStacks("env-0", "e", "ALIVE", waits=[NotedWait("reset", "http://127.0.0.1:9/reset", 5.0)])
    culprit = build_report([waiter]).culprit
    assert culprit is not None and (culprit.name, culprit.kind) == ("http://127.0.0.1:9/reset", "busy")


class Holder(rlactors.Actor):
    """Its ``hold`` notes a wait that is no actor call, as a paused rollout client does."""

    def __init__(self) -> None:
        self.go = asyncio.Event()

    async def hold(self) -> None:
        with forensics.waiting("dispatch paused", on="the weight push", backpressure="by design"):
            await self.go.wait()

    def release(self) -> None:
        self.go.set()


async def test_a_noted_wait_is_in_the_workers_stacks_labelled(cluster: rlactors.Cluster) -> None:
    holder = await cluster.spawn(Holder, name="holder")
    calls = [asyncio.ensure_future(holder.hold()) for _ in range(2)]
    report = await report_when(
        cluster, lambda r: bool(r["holder"].waits) and r["holder"].waits[0].count == 2, 30
    )
    (w,) = report["holder"].waits
    assert (w.what, w.on, w.origin, w.backpressure) == (
        "dispatch paused",
        "the weight push",
        "hold",
        "by design",
    )
    assert report.culprit is None  # the driver waits on holder, holder on the push: by design
    assert [(e.name, e.kind) for e in report.waited_on] == [("the weight push", "backpressure")]
    await holder.release()
    await wait_for(asyncio.gather(*calls), 30)
    assert not (await cluster.stacks())["holder"].waits


# A process like a worker: stacks dumps registered, and a thread running Python while its main
# thread waits. That thread recurses deeper than one of the interpreter's frame-stack chunks holds,
# so each pass maps a chunk and unmaps it. faulthandler's all-thread dump (the worker's, once) read
# those frames from its signal handler without the GIL and crashed the process with SIGSEGV within
# a few dozen dumps (https://github.com/python/cpython/issues/116008).
_CHILD = """
import signal, sys, threading
from pathlib import Path
from rlactors.base import forensics

forensics.register_dump(Path(sys.argv[1]))

def recurse(n):
    return 0 if n == 0 else recurse(n - 1) + 1

def deep():
    while True:
        recurse(300)

if sys.argv[2] == "deep":
    threading.Thread(target=deep, name="deep", daemon=True).start()
else:  # a main thread no Python handler reaches: the first signal stays pending
    signal.pthread_sigmask(signal.SIG_BLOCK, {forensics.DUMP_SIGNAL})
print("ready", flush=True)
while True:
    signal.pause()
"""


@pytest.fixture
async def child(tmp_path: Any, request: pytest.FixtureRequest) -> AsyncIterator[tuple[int, Any]]:
    dump = tmp_path / "child.stacks"
    dump.touch()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CHILD, str(dump), request.param, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert await wait_for(proc.stdout.readline(), 60) == b"ready\n"  # type: ignore[union-attr]
        yield proc.pid, dump
    finally:
        proc.kill()
        await proc.wait()


@pytest.mark.parametrize("child", ["deep"], indirect=True)
async def test_dumps_leave_alive_a_process_whose_other_thread_runs(child: tuple[int, Any]) -> None:
    pid, dump = child
    for i in range(150):
        text = await forensics.collect_dump(pid, dump, timeout_s=30.0)
        assert text is not None, f"dump {i} never came: the process died"
        assert "in recurse" in text or "in deep" in text, text  # the running thread's frames
        assert dump_loop_thread(text, None)[-1].endswith("in <module>"), text


@pytest.mark.parametrize("child", ["stuck"], indirect=True)
async def test_a_main_thread_no_python_handler_reaches_is_dumped_by_faulthandler(
    child: tuple[int, Any],
) -> None:
    pid, dump = child
    text = await forensics.collect_dump(pid, dump, timeout_s=10.0)
    assert text is not None and text.startswith("Stack (most recent call first):"), text
    assert dump_loop_thread(text, None)[-1].endswith("in <module>"), text


def test_a_dump_that_comes_inside_a_read_of_the_threads_reads_only_its_own(tmp_path: Any) -> None:
    # A dump signal's handler can run inside sys._current_frames() (a collection there runs code);
    # calling it again there would wait forever on the lock it holds (cpython#106883).
    with open(tmp_path / "x.stacks", "wb+", buffering=0) as f:
        forensics._reading_frames = True  # as inside thread_stacks()
        try:
            forensics._dump_stacks(f.fileno(), sys._getframe())
        finally:
            forensics._reading_frames = False
        f.seek(0)
        text = f.read().decode()
    assert "the other threads not read" in text and text.count(" (most recent call first):") == 1, text
    assert dump_loop_thread(text, None)[-1].endswith(
        "in test_a_dump_that_comes_inside_a_read_of_the_threads_reads_only_its_own"
    )


def test_a_dump_signal_that_lands_inside_a_dump_shows_the_program_not_the_handler(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two dumps close together (two `rlactors stack` calls, or a collector's next round): the
    # second signal's handler runs between two bytecodes of the first one's, still writing.
    write, nested = os.write, []

    def write_then_signalled(fd: int, data: bytes) -> int:
        if not nested:
            nested.append(True)
            forensics._on_dump_signal(fd, signal.SIGUSR2, sys._getframe(1))  # inside _dump_stacks
        return write(fd, data)

    monkeypatch.setattr(forensics.os, "write", write_then_signalled)
    with open(tmp_path / "x.stacks", "wb+", buffering=0) as f:
        forensics._on_dump_signal(f.fileno(), signal.SIGUSR2, sys._getframe())
        f.seek(0)
        text = f.read().decode()
    assert nested and text.count("Current thread") == 2, text
    assert "_dump_stacks" not in text and "_on_dump_signal" not in text, text
    assert dump_loop_thread(text, None)[-1].endswith(
        "in test_a_dump_signal_that_lands_inside_a_dump_shows_the_program_not_the_handler"
    ), text
