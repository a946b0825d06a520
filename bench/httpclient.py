"""Client CPU per ``/generate`` call: SGLangClient (this tree's, and optionally an older commit's)
against bare httpx and aiohttp loops (the libraries its wire was chosen over), on the same sim
servers, interleaved and repeated.

Each variant runs ``--concurrency`` loops that post one 1-sample request after another for
``--seconds`` (after ``--warmup`` seconds not counted) on a fresh uvloop, as a rollout actor's
worker runs. CPU is this process's CPU time (the sim servers are other processes) over the
calls completed; retries and errors are counted too.

    python bench/httpclient.py --servers 16 64 --concurrency 64 --repeats 3 --old HEAD~1
    python bench/httpclient.py --servers 64 --concurrency 4096 --variants client   # the retry storm
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.helpers (the repository's, not installed)

from tests.helpers.servers import start_reference_server, stop_server  # noqa: E402

NEW_TOKENS = 16
PROMPT = list(b"<user>What is 12 + 30? Think step by step.<eos>\n<assistant>")
SERVER_ARGS = ["--backend", "sim", "--sim-decode-s-base", "0.01", "--max-running-requests", "8192"]

Post = Callable[[int, int], Awaitable[None]]  # (loop index, call index) -> one /generate call


def load_old_client(rev: str) -> Any:
    """nodes/rollout/client.py, config.py, pool.py and the HTTP client under them (http1.py, or
    http1/client.py) as they were at ``rev``, as modules of their own."""
    pkg = Path(tempfile.mkdtemp(prefix="oldclient-")) / "_oldclient"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    files = {
        "client": ["client.py"],
        "config": ["config.py"],
        "pool": ["pool.py"],
        "http1": ["http1.py", "http1/client.py"],
    }
    found = {}
    for name, paths in files.items():
        for path in paths:
            show = subprocess.run(
                ["git", "show", f"{rev}:nodes/rollout/{path}"], cwd=ROOT, capture_output=True, text=True
            )
            if show.returncode == 0:
                found[name] = show.stdout
                break
    for name, src in found.items():
        for other in found:
            src = src.replace(f"nodes.rollout.{other} import", f"_oldclient.{other} import")
        (pkg / f"{name}.py").write_text(src)
    sys.path.insert(0, str(pkg.parent))
    return importlib.import_module("_oldclient.client")


def body(i: int, n: int) -> dict[str, Any]:
    return {
        "input_ids": PROMPT,
        "rid": f"b{i}-{n}",
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": NEW_TOKENS},
    }


async def sglang_client(module: Any, urls: list[str], concurrency: int) -> tuple[Post, Callable, Callable]:
    client = module.SGLangClient(urls)
    sp = {"max_new_tokens": NEW_TOKENS}

    async def post(i: int, n: int) -> None:
        r = await client.agenerate(module.GenRequest(PROMPT, sp))
        assert len(r.output_ids) == NEW_TOKENS, r

    def errors() -> dict[str, int]:
        return {k: client.counters[k] for k in ("retries", "failovers", "errors")}

    return post, errors, client.aclose


async def bare_httpx(urls: list[str], concurrency: int) -> tuple[Post, Callable, Callable]:
    """4-connection AsyncClients, loop i on server i % len(urls) (the client's lane layout)."""
    n = max(len(urls), concurrency // 4)
    clients = [
        httpx.AsyncClient(
            base_url=urls[i % len(urls)],
            timeout=600,
            limits=httpx.Limits(max_connections=4, max_keepalive_connections=4),
        )
        for i in range(n)
    ]

    async def post(i: int, n: int) -> None:
        r = await clients[i % len(clients)].post("/generate", json=body(i, n))
        r.raise_for_status()
        r.json()

    async def close() -> None:
        await asyncio.gather(*(c.aclose() for c in clients))

    return post, dict, close


async def bare_aiohttp(urls: list[str], concurrency: int, areal: bool) -> tuple[Post, Callable, Callable]:
    """``areal``: one session with AReaL's connector (limit=0, no DNS cache, a new connection per
    request: ``force_close``); else one keep-alive session per server."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=600)
    if areal:
        s = aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(limit=0, use_dns_cache=False, force_close=True)
        )
        sessions = [s] * len(urls)
    else:
        sessions = [
            aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) for _ in urls
        ]

    async def post(i: int, n: int) -> None:
        k = i % len(urls)
        async with sessions[k].post(urls[k] + "/generate", json=body(i, n)) as r:
            r.raise_for_status()
            await r.json()

    async def close() -> None:
        await asyncio.gather(*(s.close() for s in set(sessions)))

    return post, dict, close


async def measure(
    make: Callable[[], Awaitable[tuple[Post, Callable, Callable]]],
    concurrency: int,
    warmup: float,
    seconds: float,
    busy_us: float = 0.0,
) -> dict[str, Any]:
    """Calls/s and CPU per call of ``concurrency`` loops; each call is followed by ``busy_us`` of
    CPU on the event loop (the rest of a rollout actor: workflow, reward, buffer messages)."""
    post, errors, close = await make()
    calls, failed, counting = 0, 0, False
    t0 = time.monotonic()
    stop = t0 + warmup + seconds

    async def loop(i: int) -> None:
        nonlocal calls, failed
        n = 0
        while time.monotonic() < stop:
            try:
                await post(i, n)
            except Exception:  # counted, not fatal: the storm shows up here for bare loops
                failed += 1
            if busy_us:
                t = time.perf_counter() + busy_us / 1e6
                while time.perf_counter() < t:
                    pass
            n += 1
            calls += counting

    async def start_counting() -> tuple[float, float, int]:
        nonlocal counting
        await asyncio.sleep(warmup)
        counting = True
        return time.monotonic(), time.process_time(), failed

    tasks = [asyncio.ensure_future(loop(i)) for i in range(concurrency)]
    t, cpu, failed0 = await start_counting()
    await asyncio.gather(*tasks)
    wall, cpu = time.monotonic() - t, time.process_time() - cpu
    errs = errors()
    await close()
    return {
        "calls": calls,
        "calls_per_s": calls / wall,
        "cpu_us_per_call": 1e6 * cpu / max(calls, 1),
        "failed": failed - failed0,
        **errs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--busy-us", type=float, default=0.0, help="loop CPU burnt after each call")
    ap.add_argument("--old", help="also measure SGLangClient as it was at this git revision")
    ap.add_argument(
        "--variants",
        nargs="+",
        default=[
            "client",
            "old",
            "httpx",
            "aiohttp-areal",
            "aiohttp-keepalive",
        ],
    )
    args = ap.parse_args()

    import uvloop

    from nodes.rollout import client as new_client

    old = load_old_client(args.old) if args.old else None
    variants: dict[str, Callable[[list[str]], Any]] = {
        "client": lambda u: lambda: sglang_client(new_client, u, args.concurrency),
        "old": lambda u: lambda: sglang_client(old, u, args.concurrency),
        "httpx": lambda u: lambda: bare_httpx(u, args.concurrency),
        "aiohttp-areal": lambda u: lambda: bare_aiohttp(u, args.concurrency, areal=True),
        "aiohttp-keepalive": lambda u: lambda: bare_aiohttp(u, args.concurrency, areal=False),
    }
    names = [v for v in args.variants if v in variants and (v != "old" or old is not None)]
    print(
        f"# {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()},"
        f" {time.strftime('%Y-%m-%d %H:%M')}; {' '.join(sys.argv)}",
        flush=True,
    )
    for n_servers in args.servers:
        with ThreadPoolExecutor(8) as pool:
            started = list(pool.map(lambda _: start_reference_server(SERVER_ARGS), range(n_servers)))
        urls = [u for _, u in started]
        try:
            for rep in range(args.repeats):
                for name in names:
                    r = uvloop.run(
                        measure(
                            variants[name](urls), args.concurrency, args.warmup, args.seconds, args.busy_us
                        )
                    )
                    extra = " ".join(
                        f"{k}={v}"
                        for k, v in r.items()
                        if k not in ("calls", "calls_per_s", "cpu_us_per_call")
                    )
                    print(
                        f"servers={n_servers} rep={rep} {name:18s} {r['cpu_us_per_call']:7.0f} us/call"
                        f" {r['calls_per_s']:6.0f} calls/s calls={r['calls']} {extra}"
                        f" load={os.getloadavg()[0]:.1f}",
                        flush=True,
                    )
        finally:
            for proc, _ in started:
                stop_server(proc)


if __name__ == "__main__":
    main()
