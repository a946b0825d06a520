"""CPU per chat call of the OpenAI-compatible endpoint (nodes/rollout/openai_endpoint.py) against a
bare ``/generate`` call, on the same sim servers, same prompt, same number of new tokens.

The endpoint runs standalone in its own process (``python -m nodes.rollout.openai_endpoint``), so
its CPU (psutil: user + system, all threads) is measured apart from the agent's (this process) and
the servers' (processes of their own). Variants, interleaved and repeated, each ``--concurrency``
loops posting one request after another for ``--seconds`` after ``--warmup``:

- ``generate``: bare aiohttp posts of the prompt's ids to ``/generate`` (the baseline);
- ``client``: :class:`SGLangClient` ``agenerate`` in this process (what the endpoint calls inside);
- ``chat``: aiohttp posts of the chat messages to the endpoint's ``/v1/chat/completions``, the same
  messages each call, as a GRPO group's episodes open (the endpoint renders them once);
- ``chat-distinct``: the same, but each call's user message is new (every prompt rendered);
- ``chat-episode``: two-turn episodes, as an agent sends them: a new question, then that
  conversation with the answer and a follow-up (which continues the first completion's ids);
- ``chat-sdk``: the same through ``openai.AsyncOpenAI`` (the agent's SDK cost shows in this process);
- ``models``: aiohttp GETs of the endpoint's ``/v1/models`` (its HTTP serving alone, no generation);
- ``responses``: aiohttp posts of the same conversation to ``/v1/responses`` (``instructions`` and
  ``input``), as ``chat`` (target: the endpoint's CPU per call within 10% of ``chat``'s);
- ``responses-episode``: two-turn episodes as ``chat-episode``, the second request sending the first
  response's output items back with a follow-up;
- ``messages``: aiohttp posts of the same conversation to ``/v1/messages`` (Anthropic's Messages API:
  ``system`` and ``messages``), as ``chat``;
- ``messages-episode``: two-turn episodes as ``chat-episode``, the second request sending the first
  message's content blocks back with a follow-up.

``--runners`` measures instead where an agent's code runs (``agent_runner``, nodes/rollout/agents.py):
an :class:`AgentWorkflow` in this process with a generator that answers at once, groups of 4 runs
of an agent that makes one chat call (``awaits``), or one chat call then a tool that blocks 20 ms in
``time.sleep`` (``blocks``), ``--concurrency`` groups at a time; episodes/s and CPU per episode
(this process's, and the worker processes' for ``process``).

``--sessions`` measures online mode's session API (nodes/rollout/sessions.py): a process of its own
serves an :class:`OnlineWorkflow` in front of the sim servers, ``2 * --concurrency`` slots (groups of
one session) offered again as each ends, as a rollout actor would; the client's loops run two-turn
episodes, either as sessions (open, two turns at the session's base_url, the reward) or, the
baseline, the same two turns at the same process's ``/v1`` (no session). The session API's overhead
per session is the serving process's CPU per session minus its CPU per baseline episode.

The endpoint's cost per chat call is its process's CPU over the calls; what it adds is that minus
the bare ``/generate`` call's CPU (target: ≤ 300 µs). Its own work (HTTP serving, rendering,
reading the answer) is that cost minus its ``SGLangClient`` call's (the ``client`` row).

    python bench/agent_endpoint.py --servers 2 --concurrency 16 --seconds 5 --repeats 3
    python bench/agent_endpoint.py --runners --concurrency 16 --seconds 5 --repeats 3
    python bench/agent_endpoint.py --sessions --servers 2 --concurrency 16 --seconds 5 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import os
import platform
import select
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.helpers (the repository's, not installed)

from tests.helpers.servers import start_reference_server, stop_server  # noqa: E402

NEW_TOKENS = 16
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 12 + 30? Think step by step."},
]
SERVER_ARGS = [
    "--backend",
    "sim",
    "--sim-vocab-size",
    "49152",
    "--sim-eos-prob",
    "0",
    "--sim-decode-s-base",
    "0.002",
    "--max-running-requests",
    "8192",
]
TARGET_US = 300.0

Post = Callable[[int, int], Awaitable[None]]  # (loop index, call index) -> one call


def start_endpoint(urls: list[str], model_path: Path) -> tuple[subprocess.Popen, str]:
    """The standalone endpoint on a free port in front of ``urls``; its process and base_url."""
    cmd = [
        sys.executable,
        "-m",
        "nodes.rollout.openai_endpoint",
        "--model-path",
        str(model_path),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        *(a for u in urls for a in ("--server-url", u)),
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True)
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    line = proc.stdout.readline() if ready else ""  # type: ignore[union-attr]
    if not line.startswith("base_url: "):
        os.killpg(proc.pid, signal.SIGKILL)
        raise RuntimeError(f"the endpoint printed no base_url: {line!r}")
    return proc, line.removeprefix("base_url: ").strip()


async def bare_generate(urls: list[str], ids: list[int]) -> tuple[Post, Callable[[], Awaitable[None]]]:
    """One keep-alive aiohttp session per server, loop i on server i % len(urls)."""
    import aiohttp

    sessions = [aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) for _ in urls]
    sp = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0}

    async def post(i: int, n: int) -> None:
        k = i % len(urls)
        body = {"input_ids": ids, "rid": f"b{i}-{n}", "return_logprob": True, "sampling_params": sp}
        async with sessions[k].post(urls[k] + "/generate", json=body) as r:
            r.raise_for_status()
            assert len((await r.json())["output_ids"]) == NEW_TOKENS

    async def close() -> None:
        await asyncio.gather(*(s.close() for s in sessions))

    return post, close


async def rollout_client(urls: list[str], ids: list[int]) -> tuple[Post, Callable[[], Awaitable[None]]]:
    from nodes.rollout.client import GenRequest, SGLangClient

    client = SGLangClient(urls)
    sp = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0}

    async def post(i: int, n: int) -> None:
        assert len((await client.agenerate(GenRequest(ids, sp))).output_ids) == NEW_TOKENS

    return post, client.aclose


async def chat_aiohttp(base_url: str, distinct: bool = False) -> tuple[Post, Callable[[], Awaitable[None]]]:
    """``distinct``: each call asks about other numbers (a prompt the endpoint has not rendered)."""
    import aiohttp

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    body = {"model": "m", "messages": MESSAGES, "max_tokens": NEW_TOKENS, "temperature": 0}

    async def post(i: int, n: int) -> None:
        if distinct:
            ask = {"role": "user", "content": f"What is {i} + {n}? Think step by step."}
            body["messages"] = [MESSAGES[0], ask]
        async with session.post(base_url + "/chat/completions", json=body) as r:
            r.raise_for_status()
            assert (await r.json())["usage"]["completion_tokens"] == NEW_TOKENS

    return post, session.close


async def chat_episodes(base_url: str) -> tuple[Post, Callable[[], Awaitable[None]]]:
    """Loop i's even calls ask a new question, its odd calls continue that conversation."""
    import aiohttp

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    history: dict[int, list[dict[str, Any]]] = {}

    async def post(i: int, n: int) -> None:
        if n % 2 == 0:
            history[i] = [MESSAGES[0], {"role": "user", "content": f"What is {i} + {n}? Think step by step."}]
        body = {"model": "m", "messages": history[i], "max_tokens": NEW_TOKENS, "temperature": 0}
        async with session.post(base_url + "/chat/completions", json=body) as r:
            r.raise_for_status()
            answer = await r.json()
        assert answer["usage"]["completion_tokens"] == NEW_TOKENS
        history[i] = [*history[i], answer["choices"][0]["message"], {"role": "user", "content": "Go on."}]

    return post, session.close


async def models(base_url: str) -> tuple[Post, Callable[[], Awaitable[None]]]:
    import aiohttp

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def post(i: int, n: int) -> None:
        async with session.get(base_url + "/models") as r:
            r.raise_for_status()
            await r.json()

    return post, session.close


async def chat_sdk(base_url: str) -> tuple[Post, Callable[[], Awaitable[None]]]:
    import httpx
    import openai

    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    client = openai.AsyncOpenAI(
        base_url=base_url,
        api_key="unused",
        max_retries=0,
        http_client=openai.DefaultAsyncHttpxClient(limits=limits),
    )

    async def post(i: int, n: int) -> None:
        r = await client.chat.completions.create(
            model="m",
            messages=MESSAGES,
            max_tokens=NEW_TOKENS,
            temperature=0,  # type: ignore[arg-type]
        )
        assert r.usage is not None and r.usage.completion_tokens == NEW_TOKENS

    return post, client.close


async def responses_aiohttp(base_url: str) -> tuple[Post, Callable[[], Awaitable[None]]]:
    import aiohttp

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    body = {
        "model": "m",
        "instructions": MESSAGES[0]["content"],
        "input": MESSAGES[1]["content"],
        "max_output_tokens": NEW_TOKENS,
        "temperature": 0,
    }

    async def post(i: int, n: int) -> None:
        async with session.post(base_url + "/responses", json=body) as r:
            r.raise_for_status()
            assert (await r.json())["usage"]["output_tokens"] == NEW_TOKENS

    return post, session.close


async def responses_episodes(base_url: str) -> tuple[Post, Callable[[], Awaitable[None]]]:
    """As :func:`chat_episodes`: the odd calls send the first response's output items back."""
    import aiohttp

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    items: dict[int, list[dict[str, Any]]] = {}

    async def post(i: int, n: int) -> None:
        if n % 2 == 0:
            items[i] = [{"role": "user", "content": f"What is {i} + {n}? Think step by step."}]
        body = {
            "model": "m",
            "instructions": MESSAGES[0]["content"],
            "input": items[i],
            "max_output_tokens": NEW_TOKENS,
            "temperature": 0,
            "store": False,
        }
        async with session.post(base_url + "/responses", json=body) as r:
            r.raise_for_status()
            answer = await r.json()
        assert answer["usage"]["output_tokens"] == NEW_TOKENS
        items[i] = [*items[i], *answer["output"], {"role": "user", "content": "Go on."}]

    return post, session.close


async def messages_aiohttp(base_url: str) -> tuple[Post, Callable[[], Awaitable[None]]]:
    import aiohttp

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    body = {
        "model": "m",
        "system": MESSAGES[0]["content"],
        "messages": MESSAGES[1:],
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
    }

    async def post(i: int, n: int) -> None:
        async with session.post(base_url + "/messages", json=body) as r:
            r.raise_for_status()
            assert (await r.json())["usage"]["output_tokens"] == NEW_TOKENS

    return post, session.close


async def messages_episodes(base_url: str) -> tuple[Post, Callable[[], Awaitable[None]]]:
    """As :func:`chat_episodes`: the odd calls send the first message's content blocks back."""
    import aiohttp

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    history: dict[int, list[dict[str, Any]]] = {}

    async def post(i: int, n: int) -> None:
        if n % 2 == 0:
            history[i] = [{"role": "user", "content": f"What is {i} + {n}? Think step by step."}]
        body = {
            "model": "m",
            "system": MESSAGES[0]["content"],
            "messages": history[i],
            "max_tokens": NEW_TOKENS,
            "temperature": 0,
        }
        async with session.post(base_url + "/messages", json=body) as r:
            r.raise_for_status()
            answer = await r.json()
        assert answer["usage"]["output_tokens"] == NEW_TOKENS
        history[i] = [
            *history[i],
            {"role": "assistant", "content": answer["content"]},
            {"role": "user", "content": "Go on."},
        ]

    return post, session.close


async def measure(
    make: Callable[[], Awaitable[tuple[Post, Callable[[], Awaitable[None]]]]],
    endpoint: Any,
    concurrency: int,
    warmup: float,
    seconds: float,
) -> dict[str, float]:
    """Calls/s, this process's CPU per call and the endpoint process's CPU per call (psutil)."""
    post, close = await make()
    calls, counting = 0, False
    stop = time.monotonic() + warmup + seconds

    def endpoint_cpu() -> float:
        t = endpoint.cpu_times()
        return t.user + t.system

    async def loop(i: int) -> None:
        nonlocal calls
        n = 0
        while time.monotonic() < stop:
            await post(i, n)
            n += 1
            calls += counting

    tasks = [asyncio.ensure_future(loop(i)) for i in range(concurrency)]
    await asyncio.sleep(warmup)  # not a synchronisation: the warm-up time not counted
    counting = True
    t0, cpu0, ep0 = time.monotonic(), time.process_time(), endpoint_cpu()
    await asyncio.gather(*tasks)
    wall, cpu, ep = time.monotonic() - t0, time.process_time() - cpu0, endpoint_cpu() - ep0
    await close()
    n = max(calls, 1)
    return {
        "calls": calls,
        "calls_per_s": calls / wall,
        "agent_us": 1e6 * cpu / n,
        "endpoint_us": 1e6 * ep / n,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--variants",
        nargs="+",
        default=[
            "generate",
            "client",
            "chat",
            "chat-distinct",
            "chat-episode",
            "chat-sdk",
            "models",
            "responses",
            "responses-episode",
            "messages",
            "messages-episode",
        ],
    )
    ap.add_argument("--runners", action="store_true", help="measure agent_runner loop | thread | process")
    ap.add_argument("--sessions", action="store_true", help="measure the session API's overhead per session")
    ap.add_argument(
        "--serve-sessions", nargs="+", metavar="URL", help=argparse.SUPPRESS
    )  # --sessions' server
    args = ap.parse_args()
    if args.runners:
        return runners(args)
    if args.serve_sessions:
        return serve_sessions(args.serve_sessions, 2 * args.concurrency)
    if args.sessions:
        return sessions(args)

    import psutil
    import uvloop
    from transformers import AutoTokenizer

    from nodes.inference.models import ensure_tiny_checkpoint
    from nodes.rollout.chat import prompt_ids

    model_path = ensure_tiny_checkpoint()
    ids = prompt_ids(AutoTokenizer.from_pretrained(str(model_path), local_files_only=True), MESSAGES, None)
    print(
        f"# {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()},"
        f" {time.strftime('%Y-%m-%d %H:%M')}; {' '.join(sys.argv)}",
        flush=True,
    )
    started = [start_reference_server(SERVER_ARGS) for _ in range(args.servers)]
    urls = [u for _, u in started]
    ep_proc, base_url = start_endpoint(urls, model_path)
    endpoint = psutil.Process(ep_proc.pid)
    variants = {
        "generate": lambda: bare_generate(urls, ids),
        "client": lambda: rollout_client(urls, ids),
        "chat": lambda: chat_aiohttp(base_url),
        "chat-distinct": lambda: chat_aiohttp(base_url, distinct=True),
        "chat-episode": lambda: chat_episodes(base_url),
        "chat-sdk": lambda: chat_sdk(base_url),
        "models": lambda: models(base_url),
        "responses": lambda: responses_aiohttp(base_url),
        "responses-episode": lambda: responses_episodes(base_url),
        "messages": lambda: messages_aiohttp(base_url),
        "messages-episode": lambda: messages_episodes(base_url),
    }
    results: dict[str, list[dict[str, float]]] = {v: [] for v in args.variants}
    try:
        for rep in range(args.repeats):
            for name in args.variants:
                r = uvloop.run(measure(variants[name], endpoint, args.concurrency, args.warmup, args.seconds))
                results[name].append(r)
                print(
                    f"rep={rep} {name:13s} agent {r['agent_us']:6.0f} us/call  endpoint {r['endpoint_us']:6.0f}"
                    f" us/call  {r['calls_per_s']:6.0f} calls/s  calls={r['calls']}"
                    f" load={os.getloadavg()[0]:.1f}",
                    flush=True,
                )
    finally:
        os.killpg(ep_proc.pid, signal.SIGTERM)
        ep_proc.wait(timeout=20)
        for proc, _ in started:
            stop_server(proc)

    def median(name: str, key: str) -> float:
        vals = sorted(r[key] for r in results.get(name, []))
        return vals[len(vals) // 2] if vals else float("nan")

    base, client = median("generate", "agent_us"), median("client", "agent_us")
    print(f"baseline: bare /generate (aiohttp) {base:.0f} us/call; SGLangClient {client:.0f}")
    for name in (
        "chat",
        "chat-distinct",
        "chat-episode",
        "chat-sdk",
        "responses",
        "responses-episode",
        "messages",
        "messages-episode",
    ):
        if name in results:
            ep, agent = median(name, "endpoint_us"), median(name, "agent_us")
            print(
                f"{name:13s} endpoint {ep:.0f} us/call ({ep / base:.2f}x bare /generate, adds {ep - base:+.0f} us;"
                f" target <= {TARGET_US:.0f}: {'met' if ep - base <= TARGET_US else 'MISSED'});"
                f" its own work (minus its SGLangClient call) {ep - client:.0f} us; agent side {agent:.0f} us/call"
            )

    for name, like in (
        ("responses", "chat"),
        ("responses-episode", "chat-episode"),
        ("messages", "chat"),
        ("messages-episode", "chat-episode"),
    ):
        if name in results and like in results:
            r, c = median(name, "endpoint_us"), median(like, "endpoint_us")
            print(
                f"{name} endpoint {r:.0f} us/call against {like} {c:.0f}: {100 * (r / c - 1):+.1f}%"
                f" (target within 10%: {'met' if r <= 1.1 * c else 'MISSED'})"
            )


# -- agent runners -------------------------------------------------------------------------------

BLOCK_S = 0.02


async def awaits(client: Any, item: Any) -> float:
    """An agent whose every wait is awaited: one chat call."""
    await client.chat.completions.create(model="m", messages=MESSAGES)
    return 1.0


async def blocks(client: Any, item: Any) -> float:
    """One chat call, then a sync tool that blocks :data:`BLOCK_S` in ``time.sleep``."""
    await client.chat.completions.create(model="m", messages=MESSAGES)
    blocking_tool()
    return 1.0


def blocking_tool() -> None:
    time.sleep(BLOCK_S)


class Instant:
    """A generator that answers every request at once with the same 16 tokens."""

    async def agenerate(self, request: Any) -> Any:
        from nodes.rollout.client import GenResult

        ids = list(range(1000, 1000 + NEW_TOKENS))
        return GenResult(
            request.rid or "",
            ids,
            [-0.5] * len(ids),
            [0] * len(ids),
            "length",
            "",
            len(request.input_ids),
            [0],
            "instant",
        )


async def run_groups(
    wf: Any, concurrency: int, warmup: float, seconds: float, workers: Any
) -> dict[str, float]:
    """Groups back to back, ``concurrency`` at a time; episodes/s and CPU per episode."""
    gen, episodes, counting = Instant(), 0, False
    stop = time.monotonic() + warmup + seconds

    def worker_cpu() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in workers.children(recursive=True))

    async def loop(i: int) -> None:
        nonlocal episodes
        n = 0
        while time.monotonic() < stop:
            group = await wf.arun_episode(gen, {"question": "q"}, f"g{i}-{n}")
            n += 1
            episodes += counting * len(group.trajectories)

    tasks = [asyncio.ensure_future(loop(i)) for i in range(concurrency)]
    await asyncio.sleep(warmup)  # not a synchronisation: the warm-up time not counted
    counting = True
    t0, cpu0, w0 = time.monotonic(), time.process_time(), worker_cpu()
    await asyncio.gather(*tasks)
    wall, cpu, w = time.monotonic() - t0, time.process_time() - cpu0, worker_cpu() - w0
    n = max(episodes, 1)
    return {
        "episodes": episodes,
        "per_s": episodes / wall,
        "actor_us": 1e6 * cpu / n,
        "workers_us": 1e6 * w / n,
    }


def runners(args: argparse.Namespace) -> None:
    """Each agent runner with each agent, interleaved and repeated, one workflow each (its worker
    processes started in the first repeat's warm-up); medians."""
    import psutil
    import uvloop
    from transformers import AutoTokenizer

    from nodes.inference.models import ensure_tiny_checkpoint
    from nodes.rollout.agents import AgentConfig, AgentWorkflow

    tok = AutoTokenizer.from_pretrained(str(ensure_tiny_checkpoint()), local_files_only=True)
    print(
        f"# {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()},"
        f" {time.strftime('%Y-%m-%d %H:%M')}; {' '.join(sys.argv)}",
        flush=True,
    )
    me = psutil.Process()
    cases = [(agent, runner) for agent in ("awaits", "blocks") for runner in ("loop", "thread", "process")]
    workflows = {
        (agent, runner): AgentWorkflow(
            tok,
            None,
            AgentConfig(  # type: ignore[arg-type]
                agent=f"bench.agent_endpoint:{agent}",
                n_samples=4,
                agent_runner=runner,  # type: ignore[arg-type]
                agent_processes=4 * args.concurrency,
                max_new_tokens=NEW_TOKENS,
            ),
        )
        for agent, runner in cases
    }
    results: dict[tuple[str, str], list[dict[str, float]]] = {c: [] for c in cases}

    async def main() -> None:
        try:
            for rep in range(args.repeats):
                for agent, runner in cases:
                    wf = workflows[agent, runner]
                    warmup = args.warmup * (3 if rep == 0 and runner == "process" else 1)  # workers start
                    r = await run_groups(wf, args.concurrency, warmup, args.seconds, me)
                    results[agent, runner].append(r)
                    print(
                        f"rep={rep} {agent:6s} {runner:7s} {r['per_s']:7.0f} episodes/s  actor {r['actor_us']:6.0f}"
                        f" us/episode  workers {r['workers_us']:6.0f} us/episode  load={os.getloadavg()[0]:.1f}",
                        flush=True,
                    )
        finally:
            for wf in workflows.values():
                await wf.endpoint.aclose()
                wf.processes.close()

    uvloop.run(main())
    for (agent, runner), rs in results.items():
        mid = sorted(rs, key=lambda r: r["per_s"])[len(rs) // 2]
        print(
            f"median {agent:6s} {runner:7s} {mid['per_s']:7.0f} episodes/s  actor {mid['actor_us']:6.0f}"
            f" us/episode  workers {mid['workers_us']:6.0f} us/episode"
        )


# -- the session API ---------------------------------------------------------------------------------

KEY = "sk-bench"


def serve_sessions(urls: list[str], slots: int) -> None:
    """The process under measurement: an OnlineWorkflow's session API in front of ``urls``, ``slots``
    slots offered again as each group (one session) ends."""
    import uvloop
    from transformers import AutoTokenizer

    from nodes.inference.models import ensure_tiny_checkpoint
    from nodes.rollout.client import SGLangClient
    from nodes.rollout.sessions import OnlineConfig, OnlineError, OnlineWorkflow

    tok = AutoTokenizer.from_pretrained(str(ensure_tiny_checkpoint()), local_files_only=True)

    async def serve() -> None:
        client = SGLangClient(urls)
        wf = OnlineWorkflow(tok, None, OnlineConfig(n_samples=1, max_new_tokens=NEW_TOKENS, temperature=0))  # type: ignore[arg-type]
        api = await wf.start(client, api_key=KEY)
        api.endpoint.client = (
            client  # its /v1 too: the baseline's episodes (online mode serves sessions only)
        )
        print(f"base_url: {api.base}", flush=True)

        async def slot(i: int) -> None:
            for n in itertools.count():
                with contextlib.suppress(OnlineError):
                    await wf.arun_episode(client, {}, f"slot{i}/{n}")

        await asyncio.gather(*(slot(i) for i in range(slots)))

    uvloop.run(serve())


async def session_episodes(root: str, as_session: bool) -> tuple[Post, Callable[[], Awaitable[None]]]:
    """Two-turn episodes: as sessions (open, turns at its base_url, reward) or at ``/v1`` (baseline)."""
    import aiohttp

    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), headers={"Authorization": f"Bearer {KEY}"}
    )

    async def call(url: str, body: dict[str, Any]) -> Any:
        async with session.post(url, json=body) as r:
            r.raise_for_status()
            return await r.json()

    async def post(i: int, n: int) -> None:
        base, opened = root + "/v1", None
        if as_session:
            opened = await call(root + "/rl/v1/sessions", {"group": 1})
            base = opened["base_url"]
        history = [MESSAGES[0], {"role": "user", "content": f"What is {i} + {n}? Think step by step."}]
        for _ in range(2):
            body = {"model": "m", "messages": history, "max_tokens": NEW_TOKENS, "temperature": 0}
            answer = await call(base + "/chat/completions", body)
            assert answer["usage"]["completion_tokens"] == NEW_TOKENS
            history = [*history, answer["choices"][0]["message"], {"role": "user", "content": "Go on."}]
        if opened is not None:
            assert (await call(f"{root}/rl/v1/sessions/{opened['id']}/reward", {"reward": 1.0}))[
                "trajectories"
            ] == 1

    return post, session.close


def sessions(args: argparse.Namespace) -> None:
    """Sessions against the baseline's plain two-turn episodes, interleaved and repeated; medians."""
    import psutil
    import uvloop

    print(
        f"# {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()},"
        f" {time.strftime('%Y-%m-%d %H:%M')}; {' '.join(sys.argv)}",
        flush=True,
    )
    started = [start_reference_server(SERVER_ARGS) for _ in range(args.servers)]
    urls = [u for _, u in started]
    cmd = [sys.executable, __file__, "--serve-sessions", *urls, "--concurrency", str(args.concurrency)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True)
    results: dict[str, list[dict[str, float]]] = {"episode": [], "session": []}
    try:
        line = ""
        while not line.startswith("base_url: "):  # after its log lines
            line = proc.stdout.readline()  # type: ignore[union-attr]
            if not line:  # it ended
                raise RuntimeError("the session server printed no base_url")
        root, server = line.removeprefix("base_url: ").strip(), psutil.Process(proc.pid)
        for rep in range(args.repeats):
            for name in results:
                make = functools.partial(session_episodes, root, name == "session")
                r = uvloop.run(measure(make, server, args.concurrency, args.warmup, args.seconds))
                results[name].append(r)
                print(
                    f"rep={rep} {name:8s} server {r['endpoint_us']:6.0f} us/episode  client {r['agent_us']:6.0f}"
                    f" us/episode  {r['calls_per_s']:6.0f} episodes/s  load={os.getloadavg()[0]:.1f}",
                    flush=True,
                )
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
        for p, _ in started:
            stop_server(p)
    base, ses = (
        sorted(r["endpoint_us"] for r in results[k])[args.repeats // 2] for k in ("episode", "session")
    )
    print(
        f"median: two-turn episode {base:.0f} us of serving CPU; as a session {ses:.0f} us: the session API adds"
        f" {ses - base:+.0f} us per session ({100 * (ses / base - 1):+.1f}%)"
    )


if __name__ == "__main__":
    main()
