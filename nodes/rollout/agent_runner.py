"""Where an agent's code runs (``[rollout.workflow_args] agent_runner``, nodes/rollout/agents.py).

- ``"thread"``: each run in a thread of its own with its own event loop, so a tool that blocks
  (``time.sleep``, a sync HTTP call, a subprocess wait) holds up only its own episode;
- ``"loop"``: on the rollout actor's event loop, the cheapest, for agents whose every wait is
  awaited (a blocking call there stalls every episode of the actor);
- ``"process"``: in a pool of worker processes, one run per worker at a time, for agents whose own
  Python work is heavy enough to take the actor's GIL (the agent is imported there by its path; the
  item and the result must pickle).

Every run gets its own ``openai.AsyncOpenAI`` on its episode's base_url. This module imports
little (no rlactors, no tokenizer): a worker process imports it, then the agent.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib
import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["AGENT_RUNNERS", "ProcessRunner", "in_thread", "run_agent"]

AGENT_RUNNERS = ("loop", "thread", "process")


async def run_agent(agent: Callable[..., Any], url: str, item: Any, timeout: float) -> Any:
    """One run of ``agent(client, item)`` on the running loop, its client on ``url``; past
    ``timeout`` seconds it is cancelled (TimeoutError)."""
    import openai

    # no TLS to the endpoint: an SSL context without certificates (loading them costs milliseconds)
    http = openai.DefaultAsyncHttpxClient(verify=False)
    sdk = openai.AsyncOpenAI(base_url=url, api_key="rlactors", max_retries=0, http_client=http)
    try:
        async with asyncio.timeout(timeout):  # not asyncio.wait_for: it can lose a cancel on 3.11
            return await agent(sdk, item)
    finally:
        await sdk.close()


async def in_thread(agent: Callable[..., Any], url: str, item: Any, timeout: float) -> Any:
    """:func:`run_agent` in a thread of its own with its own event loop: its blocking calls block
    only it. Cancelled or out of time, the run is cancelled in its loop; a call that blocks past
    that ends when it returns (a thread cannot be stopped), its result dropped."""
    done: concurrent.futures.Future[Any] = concurrent.futures.Future()
    started: list[tuple[asyncio.AbstractEventLoop, asyncio.Task[Any]]] = []
    stop = threading.Event()

    async def main() -> Any:
        task = asyncio.current_task()
        assert task is not None
        started.append((asyncio.get_running_loop(), task))
        if stop.is_set():
            raise asyncio.CancelledError
        return await run_agent(agent, url, item, timeout)

    def body() -> None:
        if not done.set_running_or_notify_cancel():
            return
        try:
            done.set_result(asyncio.run(main()))
        except BaseException as e:
            done.set_exception(e)

    threading.Thread(target=body, name="agent-run", daemon=True).start()
    try:
        async with asyncio.timeout(timeout):
            return await asyncio.wrap_future(done)
    finally:
        stop.set()
        for loop, task in started:
            with contextlib.suppress(RuntimeError):  # its loop closed: the run had ended
                loop.call_soon_threadsafe(task.cancel)


class ProcessRunner:
    """Runs agents in ``workers`` spawned processes (started with the first run, kept)."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    async def run(self, agent: str, url: str, item: Any, timeout: float) -> Any:
        """One run of the agent at import path ``agent`` in a worker. A run still waiting for a
        worker when its time is up is withdrawn; one already running ends at its own timeout."""
        from concurrent.futures.process import BrokenProcessPool

        if self._pool is None:
            import multiprocessing

            # spawn: a fork of the actor would copy its event loop, threads and sockets
            self._pool = concurrent.futures.ProcessPoolExecutor(
                self.workers, mp_context=multiprocessing.get_context("spawn")
            )
            weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)
        fut = self._pool.submit(_process_run, agent, url, item, timeout)
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.wrap_future(fut)
        except BrokenProcessPool:  # a worker died (the agent crashed it): the next run gets a new pool
            self._pool = None
            raise
        finally:
            fut.cancel()

    def close(self) -> None:
        """Stop the workers (runs in progress end with them)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def _process_run(agent: str, url: str, item: Any, timeout: float) -> Any:
    """One run in a worker process: the agent by its import path ``module:name``."""
    module, _, name = agent.partition(":")
    fn: Any = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    return asyncio.run(run_agent(fn, url, item, timeout))
