"""Actors in real worker processes: calls, ordering, streaming, errors, cancellation, threads."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import rlactors
from rlactors.base.aio import wait_for
from tests.runtime.actors import (
    Boom,
    Cancellable,
    Compute,
    Counter,
    Heap,
    Logger,
    LoopLedger,
    Printer,
    Tricky,
)

ROOT = Path(__file__).resolve().parents[2]


async def test_call_submit_tell(cluster) -> None:
    c = await cluster.spawn(Counter, 5, name="c")
    assert await c.add(2) == 7
    fut = c.add.submit(3)
    assert isinstance(fut, asyncio.Future)
    assert await asyncio.create_task(c.add(0)) == 10  # sent after the +3, so it sees it
    assert await fut == 10
    assert await asyncio.ensure_future(c.add.submit(0)) == 10
    c.add.tell(1)
    assert await c.value() == 11  # the tell arrived before this call


async def test_what_an_actor_built_to_start_is_frozen_out_of_collections(cluster) -> None:
    """The worker freezes the heap once the actor has started (its constructor and on_start): a
    full collection never walks those objects again; what a call builds later is collected as ever."""
    heap = await cluster.spawn(Heap)
    assert await heap.walked() == {"built": False, "started": False, "later": True}


async def test_calls_from_one_caller_arrive_in_order(cluster) -> None:
    c = await cluster.spawn(Counter)
    for i in range(500):
        c.record.tell(i)
    futs = [c.record(i) for i in range(500, 1000)]
    await asyncio.gather(*futs)
    assert await c.get_log() == list(range(1000))


async def test_sync_methods_run_in_order_on_one_thread(cluster) -> None:
    a = await cluster.spawn(Compute)
    await asyncio.gather(*(a.append(i) for i in range(200)))
    assert await a.get_order() == list(range(200))


async def test_long_sync_method_does_not_block_the_loop(cluster) -> None:
    a = await cluster.spawn(Compute)
    busy = a.busy.submit(2.0)
    # While the worker thread sleeps, the loop answers async calls.
    pings = [await wait_for(a.ping(), 1.5) for _ in range(5)]
    assert pings == ["pong"] * 5
    assert not busy.done()
    assert (await busy).endswith("-sync_0")


async def test_sync_methods_on_the_loop_serve_an_asyncio_object_as_it_is(cluster) -> None:
    ledger = await cluster.spawn(LoopLedger)
    waiting = ledger.wait_len(3)  # an async method waits on the event the sync ones set
    assert await asyncio.gather(*(ledger.add(i) for i in range(3))) == ["MainThread"] * 3
    assert await wait_for(waiting, 10) == [0, 1, 2]  # in arrival order
    # A method marked blocking still runs on the worker thread; the loop keeps serving meanwhile.
    busy = ledger.busy.submit(2.0)
    assert [await wait_for(ledger.add(i), 1.5) for i in range(3, 6)] == ["MainThread"] * 3
    assert not busy.done()
    assert (await busy).endswith("-sync_0")


def test_sync_methods_takes_thread_or_loop() -> None:
    with pytest.raises(ValueError, match="sync_methods"):

        class Wrong(rlactors.Actor, sync_methods="later"):  # type: ignore[call-arg]
            pass


async def test_streaming_method(cluster) -> None:
    c = await cluster.spawn(Counter)
    assert [x async for x in c.count_to(1000)] == list(range(1000))  # beyond the credit window
    got = []
    with pytest.raises(RuntimeError, match="stream broke"):
        async for x in c.stream_then_fail(3):
            got.append(x)
    assert got == [0, 1, 2]


async def test_breaking_out_of_a_stream_cancels_it(cluster) -> None:
    c = await cluster.spawn(Counter)
    stream = c.count_to(10**9)
    async for x in stream:
        if x == 10:
            break
    await stream.aclose()
    assert await c.add(1) == 1  # the actor is still responsive


async def test_remote_exception_keeps_type_and_traceback(cluster) -> None:
    c = await cluster.spawn(Counter)
    with pytest.raises(ValueError, match="bad input") as info:
        await c.fail("bad input")
    assert "Remote traceback" in str(info.value.__cause__)
    assert "in fail" in str(info.value.__cause__)


async def test_unknown_method_is_an_attribute_error(cluster) -> None:
    c = await cluster.spawn(Counter)
    with pytest.raises(AttributeError, match="no public method 'nope'"):
        c.nope  # noqa: B018


async def test_constructor_failure_raises_at_spawn(cluster) -> None:
    with pytest.raises(RuntimeError, match="constructor exploded"):
        await cluster.spawn(Boom)
    assert all(a["state"] == "DEAD" or a["class_name"] != "Boom" for a in await cluster.actors())


async def test_cancelling_a_future_cancels_the_remote_coroutine(cluster) -> None:
    a = await cluster.spawn(Cancellable)
    fut = a.wait_forever.submit()
    assert await a.wait_started()
    fut.cancel()
    assert await wait_for(a.was_cancelled(), 10)


async def test_cancelling_the_awaiting_task_cancels_the_remote_coroutine(cluster) -> None:
    a = await cluster.spawn(Cancellable)
    task = asyncio.create_task(a.wait_forever())
    assert await a.wait_started()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await wait_for(a.was_cancelled(), 10)


async def test_max_concurrency_bounds_running_async_calls(cluster) -> None:
    c = await cluster.spawn(Counter, max_concurrency=2)
    t0 = asyncio.get_running_loop().time()
    results = await asyncio.gather(*(c.sleep(0.3) for _ in range(4)))
    elapsed = asyncio.get_running_loop().time() - t0
    assert results == ["slept"] * 4
    assert elapsed >= 0.55  # two waves of two: the bound held (a lower bound, not a speed target)


async def test_named_actors_get_actor_and_kill(cluster) -> None:
    c = await cluster.spawn(Counter, 1, name="shared")
    same = await cluster.get_actor("shared")
    assert same == c
    assert await same.add(1) == 2
    with pytest.raises(ValueError, match="already exists"):
        await cluster.spawn(Counter, name="shared")
    again = await cluster.spawn(Counter, name="shared", get_if_exists=True)
    assert again == c
    await cluster.kill(c)
    with pytest.raises(rlactors.ActorNotFoundError):
        await cluster.get_actor("shared")
    with pytest.raises(rlactors.ActorDiedError):
        await c.add(1)


async def test_arrays_and_tensors_through_actors(cluster) -> None:
    torch = pytest.importorskip("torch")
    c = await cluster.spawn(Counter)
    a = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    np.testing.assert_array_equal(await c.echo(a), a)
    t = torch.randn(300, 300, dtype=torch.bfloat16)
    assert torch.equal((await c.echo({"t": t}))["t"], t)
    comp = await cluster.spawn(Compute)
    assert await comp.total(np.ones(10_000)) == 10_000.0


async def test_handles_pass_between_actors(cluster) -> None:
    c = await cluster.spawn(Counter, 100)
    echoed = await c.echo(c)
    assert echoed == c and await echoed.add(1) == 101


async def test_actor_stdout_reaches_the_driver_with_a_prefix() -> None:
    lines: list[str] = []
    async with rlactors.init(log_sink=lines.append) as cluster:
        p = await cluster.spawn(Printer, name="printer")
        await p.say("hello from the actor")
        pid = (await cluster.actors())[0]["pid"]
        for _ in range(100):
            if any("hello from the actor" in line for line in lines):
                break
            await asyncio.sleep(0.05)
    assert f"(printer pid={pid}) hello from the actor\n" in lines


async def test_log_lines_carry_node_actor_and_call_context() -> None:
    lines: list[str] = []
    async with rlactors.init(log_sink=lines.append) as cluster:
        lg = await cluster.spawn(Logger, name="chatty")
        await lg.log_something()
        await lg.log_sync()
        for _ in range(100):
            if sum("inside a" in line for line in lines) == 2:
                break
            await asyncio.sleep(0.05)
    mine = [line for line in lines if "inside a" in line]
    assert len(mine) == 2
    for line, method in zip(mine, ("log_something", "log_sync"), strict=True):
        assert (
            "actor=chatty" in line and "node=local" in line and f"method={method}" in line and "call=" in line
        )


async def test_unpicklable_argument_fails_at_the_caller(cluster) -> None:
    c = await cluster.spawn(Counter)
    with pytest.raises(Exception, match="no pickle"):
        await c.echo(object())


def test_import_rlactors_does_not_import_torch() -> None:
    code = "import sys, rlactors, protocols.runtime.wire, protocols.runtime.codec; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


def test_actor_class_defined_in_main_script(tmp_path: Path) -> None:
    script = tmp_path / "driver.py"
    script.write_text(
        textwrap.dedent(
            """
        import asyncio
        import rlactors

        class Greeter(rlactors.Actor):
            def __init__(self, who):
                self.who = who
            async def greet(self):
                return f"hello {self.who} from {__name__}"

        class Oops(Exception):
            pass

        class Raiser(rlactors.Actor):
            async def go(self):
                raise Oops("custom")

        async def main():
            async with rlactors.init() as cluster:
                g = await cluster.spawn(Greeter, "world")
                print(await g.greet())
                r = await cluster.spawn(Raiser)
                try:
                    await r.go()
                except Oops as e:
                    print("caught", type(e).__name__, e)

        if __name__ == "__main__":
            asyncio.run(main())
        """
        )
    )
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    assert "hello world from __mp_main__" in out.stdout
    assert "caught Oops custom" in out.stdout


async def test_worker_exits_when_the_driver_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "driver.py"
    script.write_text(
        textwrap.dedent(
            """
        import asyncio, sys
        import rlactors
        from tests.runtime.actors import Counter

        async def main():
            async with rlactors.init() as cluster:
                c = await cluster.spawn(Counter)
                print(await c.pid(), flush=True)
                await asyncio.sleep(3600)

        asyncio.run(main())
        """
        )
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(script),
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        worker_pid = int((await wait_for(proc.stdout.readline(), 60)).decode())
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
        for _ in range(100):
            try:
                os.kill(worker_pid, 0)
            except ProcessLookupError:
                break
            await asyncio.sleep(0.05)
        else:
            os.kill(worker_pid, signal.SIGKILL)
            pytest.fail("worker outlived its driver")
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_cancellation_inside_the_actor_reaches_the_caller_as_an_error(cluster) -> None:
    t = await cluster.spawn(Tricky)
    with pytest.raises(RuntimeError, match="cancelled inside the actor"):
        await wait_for(t.cancelled_inside(), 10)
    assert await t.ping() == "pong"


async def test_generator_methods_refuse_submit_tell_and_group_calls(cluster) -> None:
    t = await cluster.spawn(Tricky)
    with pytest.raises(TypeError, match="generator method"):
        t.gen.submit(3)
    with pytest.raises(TypeError, match="generator method"):
        t.gen.tell(3)
    with pytest.raises(TypeError, match="generator method"):
        await rlactors.ActorGroup([t]).gen(3)


async def test_streaming_a_plain_method_is_a_type_error(cluster) -> None:
    t = await cluster.spawn(Tricky)
    with pytest.raises(TypeError, match="not a generator"):
        async for _ in t.ping.stream():
            pass
    assert await wait_for(t.ping(), 10) == "pong"  # the connection still serves calls


async def test_abandoned_stream_frees_the_actor(cluster) -> None:
    t = await cluster.spawn(Tricky, max_concurrency=1)
    async for x in t.gen(10**6):
        if x == 3:
            break
    # The dropped stream is cancelled remotely and holds no concurrency slot.
    assert await wait_for(t.ping(), 10) == "pong"
    async with t.gen(10**6) as s:
        assert await s.__anext__() == 0
    assert await wait_for(t.ping(), 10) == "pong"


async def test_very_long_output_lines_do_not_block_the_worker() -> None:
    lines: list[str] = []
    async with rlactors.init(log_sink=lines.append) as cluster:
        t = await cluster.spawn(Tricky, name="loud")
        for n in (70_000, 100_000, 100_000, 100_000, 10):
            assert await wait_for(t.print_line(n), 20) == n
    assert sum(line.count("x") for line in lines) >= 370_000


async def test_concurrent_get_if_exists_returns_the_same_live_actor(cluster) -> None:
    a, b = await asyncio.gather(*(cluster.spawn(Tricky, name="once", get_if_exists=True) for _ in range(2)))
    assert a == b
    assert await a.ping() == "pong" and await b.ping() == "pong"
