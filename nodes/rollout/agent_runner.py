"""Where an agent's code runs (``[rollout.workflow_args] agent_runner``, nodes/rollout/agents.py).

- ``"thread"``: each run in a thread of its own (from a pool; each keeps an event loop), so a tool that blocks
  (``time.sleep``, a sync HTTP call, a subprocess wait) holds up only its own episode;
- ``"loop"``: on the rollout actor's event loop, the cheapest, for agents whose every wait is
  awaited (a blocking call there stalls every episode of the actor);
- ``"process"``: in a pool of worker processes, one run per worker at a time, for agents whose own
  Python work is heavy enough to take the actor's GIL (the agent is imported there by its path; the
  item and the result must pickle).

Every run gets its own client on its episode's base_url: an ``openai.AsyncOpenAI`` (``sdk =
"openai"``) or an ``anthropic.AsyncAnthropic`` (``sdk = "anthropic"``: the same episode, its
``/v1/messages``). This module imports little (no rlactors, no tokenizer): a worker process imports
it, then the agent.
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

__all__ = ["AGENT_RUNNERS", "AGENT_SDKS", "ProcessRunner", "in_thread", "run_agent", "sdk_client"]

AGENT_RUNNERS = ("loop", "thread", "process")
AGENT_SDKS = ("openai", "anthropic")


def sdk_client(url: str, sdk: str = "openai") -> Any:
    """The client of an episode whose base_url is ``url`` (``.../v1``): ``openai.AsyncOpenAI`` on
    it, or ``anthropic.AsyncAnthropic`` on it without its ``/v1`` (that SDK adds ``/v1/messages``).
    No TLS to the endpoint: an SSL context without certificates (loading them costs milliseconds)."""
    if sdk == "anthropic":
        import anthropic

        return anthropic.AsyncAnthropic(
            base_url=url.removesuffix("/v1"),
            api_key="rlactors",
            max_retries=0,
            http_client=anthropic.DefaultAsyncHttpxClient(verify=False),
        )
    if sdk != "openai":
        raise ValueError(f"agent sdk {sdk!r}: use {' or '.join(AGENT_SDKS)}")
    import openai

    http = openai.DefaultAsyncHttpxClient(verify=False)
    return openai.AsyncOpenAI(base_url=url, api_key="rlactors", max_retries=0, http_client=http)


async def run_agent(
    agent: Callable[..., Any], url: str, item: Any, timeout: float, sdk: str = "openai"
) -> Any:
    """One run of ``agent(client, item)`` on the running loop, its client (:func:`sdk_client`) on
    ``url``; past ``timeout`` seconds it is cancelled (TimeoutError)."""
    client = sdk_client(url, sdk)
    try:
        async with asyncio.timeout(timeout):  # not asyncio.wait_for: it can lose a cancel on 3.11
            return await agent(client, item)
    finally:
        await client.close()


# Threads that run agents, each with an event loop of its own that it keeps from run to run (a loop
# per run, as asyncio.run makes, cost a new default executor and its threads each time: the DNS
# lookup of the episode's URL runs there). Runs beyond MAX_THREADS at once wait for a thread.
MAX_THREADS = 512
_threads: concurrent.futures.ThreadPoolExecutor | None = None
_local = threading.local()


def _thread_loop() -> asyncio.AbstractEventLoop:
    loop = getattr(_local, "loop", None)
    if loop is None:
        try:
            import uvloop

            loop = uvloop.new_event_loop()
        except ImportError:
            loop = asyncio.new_event_loop()
        _local.loop = loop
    return loop


async def in_thread(
    agent: Callable[..., Any], url: str, item: Any, timeout: float, sdk: str = "openai"
) -> Any:
    """:func:`run_agent` in a thread of its own (from a pool) on that thread's event loop: its
    blocking calls block only it. Cancelled or out of time, the run is cancelled in its loop; a call
    that blocks past that ends when it returns (a thread cannot be stopped), its result dropped."""
    global _threads
    if _threads is None:
        _threads = concurrent.futures.ThreadPoolExecutor(MAX_THREADS, thread_name_prefix="agent-run")
    started: list[tuple[asyncio.AbstractEventLoop, asyncio.Task[Any]]] = []
    stop = threading.Event()

    def body() -> Any:
        loop = _thread_loop()
        task = loop.create_task(run_agent(agent, url, item, timeout, sdk))
        started.append((loop, task))
        if stop.is_set():
            task.cancel()
        try:
            return loop.run_until_complete(task)
        finally:  # what the run left behind (a framework's background tasks) ends with it
            rest = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in rest:
                t.cancel()
            if rest:
                loop.run_until_complete(asyncio.gather(*rest, return_exceptions=True))

    done = _threads.submit(body)
    try:
        async with asyncio.timeout(timeout):
            return await asyncio.wrap_future(done)
    finally:
        stop.set()
        done.cancel()  # not started yet: never starts
        for loop, task in started:
            with contextlib.suppress(RuntimeError):  # its loop closed: the run had ended
                loop.call_soon_threadsafe(task.cancel)


class ProcessRunner:
    """Runs agents in ``workers`` spawned processes (started with the first run, kept)."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    async def run(self, agent: str, url: str, item: Any, timeout: float, sdk: str = "openai") -> Any:
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
        fut = self._pool.submit(_process_run, agent, url, item, timeout, sdk)
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


def _process_run(agent: str, url: str, item: Any, timeout: float, sdk: str) -> Any:
    """One run in a worker process: the agent by its import path ``module:name``."""
    module, _, name = agent.partition(":")
    fn: Any = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    return asyncio.run(run_agent(fn, url, item, timeout, sdk))
