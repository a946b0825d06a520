"""Many sim reference servers in one process, one port each (bench only).

A sim server process holds ~56 MiB, so 256 of them would need 14 GiB and 256 interpreters on 2
cores; here each port gets its own Engine (scheduler, radix cache) and its own uvicorn server,
all on one event loop. Requests see exactly the reference server's app (``create_app``).

Each server also records, for the benchmark, what only the server can see the same way for
every client: the gap from ``/continue_generation`` to the scheduler's first step with a request
to run (how long a continued server sits idle: a client that re-posts after the continue makes it
wait for the re-post; requests posted during the pause wait in the queue and run at once), and the
share of a resumed request's prefix served from the cache (a
request whose input is exactly the tokens of a request aborted by a pause). ``GET /bench_stats``
returns them; ``POST /bench_reset`` clears them.

    python bench/simfarm.py --count 64 --port-file ports.txt -- --backend sim --sim-decode-s-base 0.01

or, from a benchmark, ``Farm(n, procs, server_argv)``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


class _Load:
    """Requests in flight in this process (all its servers), with its high-water mark and, per
    ``BUCKET_S`` of time, the lowest and highest count and the count at the bucket's end: summing the
    processes' lows over the same bucket gives a farm-wide count that held at one instant (a lower
    bound on the farm's peak), summing their highs an upper bound."""

    BUCKET_S = 0.01

    def __init__(self) -> None:
        self.n = 0
        self.reset()

    def reset(self) -> None:
        """A new measurement: requests in flight now stay counted."""
        self.hwm = self.n
        self.buckets: dict[int, list[int]] = {int(time.monotonic() / self.BUCKET_S): [self.n] * 3}

    def add(self, d: int) -> None:
        self.n += d
        self.hwm = max(self.hwm, self.n)
        k = int(time.monotonic() / self.BUCKET_S)
        b = self.buckets.get(k)
        if b is None:
            self.buckets[k] = [min(self.n, self.n - d), max(self.n, self.n - d), self.n]
        else:
            b[0], b[1], b[2] = min(b[0], self.n), max(b[1], self.n), self.n

    def stats(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "hwm": self.hwm, "buckets": self.buckets}


_LOAD = _Load()


def farm_inflight(loads: list[dict[str, Any]]) -> tuple[int, int]:
    """Farm-wide requests in flight at the peak, from each process's buckets: (lower, upper) bound.
    A process with no change in a bucket held the count it ended its last bucket with."""
    keys = sorted({int(k) for x in loads for k in x["buckets"]})
    last = [0] * len(loads)
    lo = hi = 0
    for k in keys:
        mins = maxs = 0
        for i, x in enumerate(loads):
            b = x["buckets"].get(str(k)) or x["buckets"].get(k)
            if b is None:
                mins, maxs = mins + last[i], maxs + last[i]
            else:
                mins, maxs, last[i] = mins + b[0], maxs + b[1], b[2]
        lo, hi = max(lo, mins), max(hi, maxs)
    return lo, hi


class _Probe:
    """Resume gaps and resumed-prefix cache hits of one server's scheduler (wraps four methods)."""

    def __init__(self, sched: Any, report_load: bool) -> None:
        self.sched, self.report_load = sched, report_load
        self.gaps: list[float] = []
        self.idle_gaps: list[float] = []  # those of a server with nothing queued when it continued
        self._idle_at_continue = False
        self.resumed_prefix = self.resumed_cached = self.resumed = self.generates = 0
        self._continued_at: float | None = None
        self._aborted: set[int] = set()
        pause, resume, submit, step = sched.pause, sched.resume, sched.submit, sched._step

        async def pause_(mode: str) -> None:
            reqs = list(sched.by_rid.values()) if mode == "abort" else []
            await pause(mode)  # a step in progress ends first, and adds a token to each running request
            # what a client will re-post: prompt + what was generated, read once the aborts are answered
            self._aborted |= {hash(tuple(r.seq.ids)) for r in reqs if r.seq.output_ids}

        def resume_() -> None:
            self._continued_at = time.monotonic()
            self._idle_at_continue = not sched.waiting  # no re-post had reached it yet
            resume()

        def submit_(seq: Any, return_logprob: bool, stream: bool = False, **kw: Any) -> asyncio.Future:
            self.generates += 1
            fut = submit(seq, return_logprob, stream, **kw)
            _LOAD.add(1)
            fut.add_done_callback(lambda _f: _LOAD.add(-1))
            key = hash(tuple(seq.input_ids)) if self._aborted else None
            if key is not None and key in self._aborted:
                self._aborted.discard(key)
                req = sched.by_rid.get(seq.rid)
                if req is not None:
                    fut.add_done_callback(lambda _f, r=req, n=len(seq.input_ids) - 1: self._hit(r, n))
            return fut

        async def step_() -> bool:
            if self._continued_at is not None and (sched.waiting or sched.running):
                self.gaps.append(time.monotonic() - self._continued_at)
                if self._idle_at_continue:
                    self.idle_gaps.append(self.gaps[-1])
                self._continued_at = None
            return await step()

        sched.pause, sched.resume, sched.submit, sched._step = pause_, resume_, submit_, step_

    def _hit(self, req: Any, prefix: int) -> None:
        self.resumed += 1
        self.resumed_prefix += prefix
        self.resumed_cached += min(prefix, req.cached_tokens or 0)

    def stats(self) -> dict[str, Any]:
        return {
            "gaps": self.gaps,
            "idle_gaps": self.idle_gaps,
            "resumed": self.resumed,
            "resumed_prefix": self.resumed_prefix,
            "resumed_cached": self.resumed_cached,
            "generates": self.generates,
            "inflight": len(self.sched.by_rid),
            **({"load": _LOAD.stats()} if self.report_load else {}),
        }

    def reset(self) -> None:
        self.gaps, self.idle_gaps, self._continued_at, self._aborted = [], [], None, set()
        self.resumed_prefix = self.resumed_cached = self.resumed = self.generates = 0


def _routes(app: Any, probe: _Probe) -> None:
    from starlette.requests import Request
    from starlette.responses import JSONResponse

    async def stats(request: Request) -> JSONResponse:
        return JSONResponse(probe.stats())

    async def reset(request: Request) -> JSONResponse:
        probe.reset()
        _LOAD.reset()
        return JSONResponse({})

    app.add_route("/bench_stats", stats, methods=["GET"])
    app.add_route("/bench_reset", reset, methods=["POST"])


async def serve(count: int, port_file: str, server_argv: list[str]) -> None:
    """Serve ``count`` servers on ports the kernel picks (bound here, so none is taken twice);
    write the ports to ``port_file`` once every server is up."""
    import socket

    import uvicorn

    from nodes.inference.engine import Engine
    from nodes.inference.server import create_app, parse_args

    servers, socks = [], []
    for _ in range(count):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        socks.append(sock)
        engine = Engine(parse_args([*server_argv, "--port", str(sock.getsockname()[1])]))
        app = create_app(engine)
        probe = _Probe(engine.scheduler, report_load=not servers)  # one server reports the process's load
        _routes(app, probe)
        cfg = uvicorn.Config(app, log_level="warning", timeout_keep_alive=30, lifespan="on", loop="none")
        servers.append(uvicorn.Server(cfg))
    for s in servers:  # uvicorn installs signal handlers per server: one SIGTERM handler for all
        s.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    tasks = [asyncio.create_task(s.serve([k])) for s, k in zip(servers, socks, strict=True)]
    while not all(s.started for s in servers):  # noqa: ASYNC110 (uvicorn's started is a flag, no event)
        await asyncio.sleep(0.05)
    Path(port_file + ".tmp").write_text(  # noqa: ASYNC240 (once, at start-up)
        " ".join(str(k.getsockname()[1]) for k in socks)
    )
    os.replace(port_file + ".tmp", port_file)
    await stop.wait()
    for s in servers:
        s.should_exit = True
    await asyncio.gather(*tasks, return_exceptions=True)


class Farm:
    """``n`` sim servers over ``procs`` processes of this module; ``urls`` once started."""

    def __init__(self, n: int, procs: int, server_argv: list[str]) -> None:
        self.urls: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self._logs = []
        self._dir = tempfile.mkdtemp(prefix="simfarm-")
        procs = min(procs, n)
        for i in range(procs):
            log = tempfile.NamedTemporaryFile(prefix="simfarm-", suffix=".log", delete=False)
            count = n // procs + (i < n % procs)
            cmd = [
                sys.executable,
                __file__,
                "--count",
                str(count),
                "--port-file",
                f"{self._dir}/{i}",
                "--",
                *server_argv,
            ]
            self.procs.append(
                subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            )
            self._logs.append(log)

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        files = [Path(self._dir, str(i)) for i in range(len(self.procs))]
        while not all(f.exists() for f in files):
            for p, log in zip(self.procs, self._logs, strict=True):
                if p.poll() is not None:
                    raise RuntimeError(f"simfarm exited: {Path(log.name).read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"simfarm: not up after {timeout_s} s")
            time.sleep(0.1)  # start-up poll
        by_proc = [[f"http://127.0.0.1:{p}" for p in f.read_text().split()] for f in files]
        self.urls = [u for i in range(max(map(len, by_proc))) for urls in by_proc for u in urls[i : i + 1]]
        with httpx.Client(timeout=10) as c:
            assert c.get(self.urls[-1] + "/health").status_code == 200

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def close(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for log in self._logs:
            log.close()
            with contextlib.suppress(OSError):
                os.unlink(log.name)


async def flush_caches(urls: list[str]) -> None:
    """Empty every server's prefix cache (``/flush_cache``; the servers must be idle), so each variant
    starts from the same state: a cache that has filled holds many short branches, and a farm
    process's CPU per call rose by about a quarter over a minute of load as its trees grew."""
    import aiohttp

    async with aiohttp.ClientSession() as s:

        async def one(u: str) -> None:
            for _ in range(50):  # requests of the last variant may still be finishing their abort
                async with s.post(u + "/flush_cache") as r:
                    if r.status == 200:
                        return
                await asyncio.sleep(0.1)
            raise RuntimeError(f"{u}/flush_cache: the server still has requests after 5 s")

        await asyncio.gather(*(one(u) for u in urls))


async def probe_stats(urls: list[str], reset: bool = False) -> dict[str, Any]:
    """Every server's probe, summed: resume gaps (all of them, seconds) and resumed-prefix hits."""
    import aiohttp

    async with aiohttp.ClientSession() as s:

        async def one(u: str) -> dict[str, Any]:
            async with s.request(
                "POST" if reset else "GET", u + ("/bench_reset" if reset else "/bench_stats")
            ) as r:
                return await r.json()

        got = await asyncio.gather(*(one(u) for u in urls))
    if reset:
        return {}
    loads = [x["load"] for x in got if "load" in x]  # one per farm process
    lo, hi = farm_inflight(loads)
    return {
        "gaps": sorted(g for x in got for g in x["gaps"]),
        "idle_gaps": sorted(g for x in got for g in x["idle_gaps"]),
        "farm_inflight_peak": (lo, hi),
        "farm_inflight_hwm_sum": sum(x["hwm"] for x in loads),
        **{
            k: sum(x[k] for x in got)
            for k in ("resumed", "resumed_prefix", "resumed_cached", "generates", "inflight")
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, required=True)
    ap.add_argument("--port-file", required=True)
    ap.add_argument("server_args", nargs=argparse.REMAINDER, help="after --: the reference server's flags")
    args = ap.parse_args()
    argv = [a for a in args.server_args if a != "--"]
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(args.count, args.port_file, argv))


if __name__ == "__main__":
    main()
