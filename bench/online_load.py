"""Load held: many concurrent legitimate multi-turn sessions through ONE rollout actor's session API
(online mode, nodes/rollout/sessions.py), alone and while hostile clients attack the same server.

Three kinds of process, all on loopback:

- the serving process (``--serve``): an :class:`OnlineWorkflow` as a rollout actor runs it, behind a
  key, with its default HTTP limits (``[rollout.workflow_args.http]``), ``--sessions`` slots offered
  again as each group (one session) ends, generating through an :class:`SGLangClient` in front of
  sim reference servers (bench/simfarm.py, ``--servers`` of them in ``--farm-procs`` processes); its
  heap frozen once started, as an actor's worker freezes it;
- the legitimate clients (this process): ``--sessions`` loops, each opening a session, making
  ``--turns`` chat turns at its base_url (each turn continues the conversation), then posting its
  reward, again and again; between a turn's answer and the next call each waits ``--think-s`` on
  average (drawn from half to one and a half of it; each loop starts at a random instant of the
  first ``--think-s``: agents that do not march in step). A 429 (no slot free this instant) is
  retried after its Retry-After. They speak HTTP/1.1 through the rollout client's own keep-alive
  pool, cheaper per call than aiohttp, to leave the cores to the processes measured;
- the attackers (``--attack``, a process of their own): ``--tricklers`` clients that send a request
  head one byte every 2 s (reconnecting when closed), and ``--abusers`` clients that each send, in
  turn, a 32 MiB body without the key, a 64 KiB header, 100,000 headers and an 8 MiB URL, as fast as
  they are answered.

Two phases of ``--seconds`` each, after ``--warmup``: ``alone``, then ``attacked`` (the attackers
started ``--warmup`` before it). Per phase: sessions/s completed, p50/p99/max latency of a chat turn
and of any call, and the slowest call started in each second; the serving process's CPU (psutil,
user + system) per session and its share of one core, its memory (RSS) and the growth per open
session over the idle process, errors, the attack's refusals as the server counted them (its
``http_*`` counters); and where a turn's time goes: the generations' p50/p99/max as the serving
process saw them (the sim servers' share), its loop's largest lag and its longest gen-2 garbage
collection, this process's own largest loop lag (a stall of the measuring side), and the CPU of
every process (what the machine's cores were spent on).

Full size (the issue's)::

    python bench/online_load.py --sessions 2000 --turns 3 --think-s 5 --servers 4 --tricklers 200 --abusers 50 --seconds 30 --warmup 15
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import json
import os
import platform
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.simfarm import Farm  # noqa: E402
from rlactors.base.forensics import LoopProbe  # noqa: E402

KEY = "sk-bench-online"
NEW_TOKENS = 8
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


# -- the serving process ----------------------------------------------------------------------


def serve(urls: list[str], slots: int) -> None:
    """An OnlineWorkflow's session API in front of ``urls``, ``slots`` slots offered again as each
    group ends; prints its base URL, then answers ``stats`` lines on stdin with its counters."""
    import uvloop
    from transformers import AutoTokenizer

    from nodes.inference.models import ensure_tiny_checkpoint
    from nodes.rollout.client import SGLangClient
    from nodes.rollout.sessions import OnlineConfig, OnlineError, OnlineWorkflow

    tok = AutoTokenizer.from_pretrained(str(ensure_tiny_checkpoint()), local_files_only=True)

    async def main() -> None:
        client = SGLangClient(urls)
        gen_s: list[float] = []  # each generation's time as this process saw it (the upstream's share)
        agenerate = client.agenerate

        async def timed(request: Any) -> Any:
            t0 = time.monotonic()
            try:
                return await agenerate(request)
            finally:
                gen_s.append(time.monotonic() - t0)

        client.agenerate = timed  # type: ignore[method-assign]
        wf = OnlineWorkflow(tok, None, OnlineConfig(n_samples=1, max_new_tokens=NEW_TOKENS, temperature=0))  # type: ignore[arg-type]
        api = await wf.start(client, api_key=KEY)
        gc.collect()
        gc.freeze()  # as a rollout actor's worker does once the actor has started
        print(f"base_url: {api.base}", flush=True)

        async def slot(i: int) -> None:
            for n in itertools.count():
                with contextlib.suppress(OnlineError):
                    await wf.arun_episode(client, {}, f"slot{i}/{n}")

        probe = LoopProbe()  # how late this process's loop wakes: a stall of the server itself
        probe.start()
        lag = {"max_s": 0.0}

        gc_t: dict[str, Any] = {"t": 0.0, "max_s": 0.0, "n": 0}

        def on_gc(phase: str, info: dict[str, Any]) -> None:
            if phase == "start":
                gc_t["t"] = time.perf_counter()
            elif info["generation"] == 2:
                gc_t["max_s"] = max(gc_t["max_s"], time.perf_counter() - gc_t["t"])
                gc_t["n"] += 1

        gc.callbacks.append(on_gc)

        async def stats() -> None:
            loop = asyncio.get_running_loop()
            reader = asyncio.StreamReader()
            await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
            while line := await reader.readline():
                lag["max_s"] = max(lag["max_s"], probe.report()["max_lag_s"])
                if line.strip() == b"reset":
                    gen_s.clear()
                    lag["max_s"] = gc_t["max_s"] = 0.0
                    gc_t["n"] = 0
                    continue
                gens = sorted(gen_s)
                print(
                    "stats: "
                    + json.dumps(
                        {
                            **wf.counters,
                            "open_sessions": len(api.sessions),
                            "connections": len(api.endpoint._server._connections),
                            "loop_max_lag_ms": 1000 * lag["max_s"],
                            "gc2_max_ms": 1000 * gc_t["max_s"],
                            "gc2_n": gc_t["n"],
                            "generate_p50_ms": 1000 * gens[len(gens) // 2] if gens else None,
                            "generate_p99_ms": 1000 * gens[int(0.99 * len(gens))] if gens else None,
                            "generate_max_ms": 1000 * gens[-1] if gens else None,
                        }
                    ),
                    flush=True,
                )

        await asyncio.gather(stats(), *(slot(i) for i in range(slots)))

    uvloop.run(main())


# -- the attackers ----------------------------------------------------------------------------


def attack(host: str, port: int, tricklers: int, abusers: int) -> None:
    """``tricklers`` slow-head clients and ``abusers`` oversized/unauthenticated ones, until killed."""
    import uvloop

    counts = {"trickler_closed": 0, "abuse_answered": 0, "abuse_reset": 0}

    async def trickler() -> None:
        while True:
            try:
                reader, writer = await asyncio.open_connection(host, port)
                writer.write(b"POST /rl/v1/sessions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                answered = asyncio.ensure_future(reader.read())  # until the server closes
                while not answered.done():
                    writer.write(b"a")
                    await writer.drain()
                    await asyncio.wait([answered], timeout=2.0)
            except OSError:
                pass
            # a reset, once the server closed it unread: expected
            with contextlib.suppress(Exception):
                answered.exception()
            counts["trickler_closed"] += 1
            with contextlib.suppress(Exception):  # closing a connection the server reset
                writer.close()

    shapes = [
        b"POST /rl/v1/sessions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (32 << 20),
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (64 << 10) + b"\r\n\r\n",
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + b"X: 1\r\n" * 100_000 + b"\r\n",
        b"GET /" + b"a" * (8 << 20) + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    ]
    body = b"x" * (32 << 20)

    async def abuser(i: int) -> None:
        for n in itertools.count(i):
            try:
                reader, writer = await asyncio.open_connection(host, port)
                writer.write(shapes[n % len(shapes)])
                if n % len(shapes) == 0:
                    writer.write(body)
                got = await reader.read(1 << 16)
                counts["abuse_answered" if got else "abuse_reset"] += 1
                writer.transport.abort()
            except OSError:
                counts["abuse_reset"] += 1

    async def main() -> None:
        tasks = [asyncio.ensure_future(trickler()) for _ in range(tricklers)]
        tasks += [asyncio.ensure_future(abuser(i)) for i in range(abusers)]
        while True:
            await asyncio.sleep(5)
            print("attack: " + json.dumps(counts), flush=True)

    uvloop.run(main())


# -- the legitimate clients -------------------------------------------------------------------


async def sessions_for(
    root: str, n: int, turns: int, think_s: float, seconds: float, warmup: float, mark: dict[str, Any]
) -> dict[str, Any]:
    """``n`` session loops for ``warmup + seconds`` (``think_s`` between a turn and the next call, on
    average: each pause is drawn uniformly from half to one and a half of it, and each loop starts
    at a random instant of the first ``think_s``, as agents that do not march in step); what was
    measured after the warm-up. They speak HTTP/1.1 through the rollout client's own
    keep-alive pool (nodes/rollout/http1/client.py), a connection per loop: a client that costs the
    machine a fraction of aiohttp's CPU per call, left to the server it loads."""
    from nodes.rollout.http1.client import ClientPool

    host, port = root.removeprefix("http://").rsplit(":", 1)
    pool = ClientPool(host, int(port), max_connections=n, keepalive_s=3600.0, connect_timeout_s=60.0)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    turn_lat: list[float] = []
    call_lat: list[float] = []
    worst: dict[int, float] = {}  # per second of the phase (by a call's start), its slowest call
    out = {"sessions": 0, "turns": 0, "retries_429": 0, "errors": 0}
    start = time.monotonic()
    measuring_from, until = start + warmup, start + warmup + seconds

    async def call(path: str, body: dict[str, Any], is_turn: bool = False) -> tuple[int, Any]:
        t0 = time.monotonic()
        status, raw = await pool.request("POST", path, orjson.dumps(body), headers, 120.0)
        data = orjson.loads(raw) if raw else None
        t1 = time.monotonic()
        if t0 >= measuring_from and t1 <= until:
            call_lat.append(t1 - t0)
            k = int(t0 - measuring_from)
            worst[k] = max(worst.get(k, 0.0), t1 - t0)
            if is_turn:
                turn_lat.append(t1 - t0)
        if status == 429:  # no slot free this instant: the server's Retry-After is 1 s
            out["retries_429"] += 1
            await asyncio.sleep(1.0)
        return status, data

    async def loop(i: int) -> None:
        rng = random.Random(i)
        await asyncio.sleep(rng.uniform(0, think_s))
        for k in itertools.count():
            if time.monotonic() >= until:
                return
            try:
                status, opened = await call("/rl/v1/sessions", {"group": 1})
                if status != 200:
                    continue
                base = urlsplit(opened["base_url"]).path
                history = [{"role": "user", "content": f"What is {i} + {k}?"}]
                for _ in range(turns):
                    body = {"model": "m", "messages": history, "max_tokens": NEW_TOKENS, "temperature": 0}
                    status, answer = await call(base + "/chat/completions", body, is_turn=True)
                    assert status == 200, answer
                    history = [
                        *history,
                        answer["choices"][0]["message"],
                        {"role": "user", "content": "Go on."},
                    ]
                    if time.monotonic() >= measuring_from:
                        out["turns"] += 1
                    # the agent's own work between turns (a tool, a thought)
                    await asyncio.sleep(rng.uniform(0.5 * think_s, 1.5 * think_s))
                status, _ = await call(f"/rl/v1/sessions/{opened['id']}/reward", {"reward": 1.0})
                assert status == 200
                if measuring_from <= time.monotonic() <= until:
                    out["sessions"] += 1
            except Exception as e:  # counted and reported: a legitimate call must not fail
                out["errors"] += 1
                out.setdefault("first_error", f"{repr(e)[:300]} at {time.monotonic() - start:.1f} s")

    async def sample() -> None:
        # in a thread: the serving process's answers must not hold up this loop's clients
        await asyncio.sleep(max(0.0, measuring_from - time.monotonic()))
        await asyncio.to_thread(mark["begin"])
        while time.monotonic() < until:
            await asyncio.to_thread(mark["sample"])
            await asyncio.sleep(1.0)
        await asyncio.to_thread(mark["end"])

    probe = LoopProbe()  # how late this process's loop wakes: a stall of the measuring side
    probe.start()
    client_lag = {"max_s": 0.0}

    async def lagged() -> None:
        await asyncio.sleep(max(0.0, measuring_from - time.monotonic()))
        probe.report()  # the warm-up's lag is not the measurement's
        await asyncio.sleep(max(0.0, until - time.monotonic()))
        client_lag["max_s"] = probe.report()["max_lag_s"]
        probe.stop()

    gc.collect()
    gc.freeze()  # what this process imported: a full collection need not walk it again
    await asyncio.gather(sample(), lagged(), *(loop(i) for i in range(n)))
    pool.close()

    def pct(xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else float("nan")

    out.update(
        turn_p50_ms=pct(turn_lat, 0.5),
        turn_p99_ms=pct(turn_lat, 0.99),
        turn_max_ms=pct(turn_lat, 1.0),
        call_p99_ms=pct(call_lat, 0.99),
        sessions_per_s=out["sessions"] / seconds,
        client_loop_max_lag_ms=1000 * client_lag["max_s"],
        slowest_call_ms_by_second=[round(1000 * worst.get(k, 0.0)) for k in range(int(seconds))],
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=2000, help="concurrent legitimate session loops")
    ap.add_argument("--turns", type=int, default=3, help="chat turns per session")
    ap.add_argument(
        "--think-s",
        type=float,
        default=2.0,
        help="the client's time between a turn's answer and its next call",
    )
    ap.add_argument("--servers", type=int, default=4, help="sim servers")
    ap.add_argument("--farm-procs", type=int, default=2, help="simfarm processes the sim servers share")
    ap.add_argument("--tricklers", type=int, default=200)
    ap.add_argument("--abusers", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=60.0, help="each phase's measured time")
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--serve", nargs="+", metavar="URL", help=argparse.SUPPRESS)
    ap.add_argument("--attack", nargs=2, metavar=("HOST", "PORT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve(args.serve, args.sessions)
    if args.attack:
        return attack(args.attack[0], int(args.attack[1]), args.tricklers, args.abusers)
    run(args)


def run(args: argparse.Namespace) -> None:
    import psutil
    import uvloop

    print(
        f"# {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()},"
        f" {time.strftime('%Y-%m-%d %H:%M')}; {' '.join(sys.argv)}",
        flush=True,
    )
    farm = Farm(args.servers, args.farm_procs, SERVER_ARGS)
    procs: list[subprocess.Popen] = []
    try:
        farm.wait_ready()
        cmd = [sys.executable, __file__, "--serve", *farm.urls, "--sessions", str(args.sessions)]
        server = subprocess.Popen(
            cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        procs.append(server)
        line = ""
        while not line.startswith("base_url: "):
            line = server.stdout.readline()  # type: ignore[union-attr]
            if not line:
                raise RuntimeError("the serving process printed no base_url")
        root = line.removeprefix("base_url: ").strip()
        host, port = root.removeprefix("http://").rsplit(":", 1)
        ps = psutil.Process(server.pid)

        def counters() -> dict[str, Any]:
            server.stdin.write("stats\n")  # type: ignore[union-attr]
            server.stdin.flush()  # type: ignore[union-attr]
            while not (line := server.stdout.readline()).startswith("stats: "):  # type: ignore[union-attr]
                pass
            return json.loads(line.removeprefix("stats: "))

        idle_rss = ps.memory_info().rss
        # the other processes' CPU, to say what the load was limited by: the sim servers, this client
        others = {"farm": [psutil.Process(p) for p in farm.pids()], "clients": [psutil.Process()]}

        def cpu_of(procs: list[Any]) -> float:
            total = 0.0
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    total += sum(p.cpu_times()[:2])
            return total

        results = {}
        for phase in ("alone", "attacked"):
            if phase == "attacked":
                att = subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "--attack",
                        host,
                        port,
                        "--tricklers",
                        str(args.tricklers),
                        "--abusers",
                        str(args.abusers),
                    ],
                    cwd=ROOT,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
                procs.append(att)
                others["attack"] = [psutil.Process(att.pid)]
            m: dict[str, Any] = {"rss": [], "open": []}

            def begin(m: dict[str, Any] = m) -> None:
                server.stdin.write("reset\n")  # type: ignore[union-attr]
                m["cpu0"], m["t0"], m["c0"] = sum(ps.cpu_times()[:2]), time.monotonic(), counters()
                m["others0"] = {k: cpu_of(v) for k, v in others.items()}

            def sample(m: dict[str, Any] = m) -> None:
                m["rss"].append(ps.memory_info().rss)
                m["open"].append(counters()["open_sessions"])

            def end(m: dict[str, Any] = m) -> None:
                m["cpu1"], m["t1"], m["c1"] = sum(ps.cpu_times()[:2]), time.monotonic(), counters()
                m["others1"] = {k: cpu_of(v) for k, v in others.items()}

            r = uvloop.run(
                sessions_for(
                    root,
                    args.sessions,
                    args.turns,
                    args.think_s,
                    args.seconds,
                    args.warmup,
                    {"begin": begin, "sample": sample, "end": end},
                )
            )
            cpu = m["cpu1"] - m["cpu0"]
            peak = max(m["rss"])
            mean_open = sum(m["open"]) / len(m["open"])
            r.update(
                server_cpu_share=cpu / (m["t1"] - m["t0"]),
                server_cpu_ms_per_session=1000 * cpu / max(1, r["sessions"]),
                rss_idle_mib=idle_rss / 2**20,
                rss_peak_mib=peak / 2**20,
                rss_growth_mib=(peak - idle_rss) / 2**20,
                open_sessions_mean=mean_open,
                rss_kib_per_open_session=(peak - idle_rss) / 1024 / max(1.0, mean_open),
                refused={k: m["c1"][k] - m["c0"][k] for k in m["c1"] if k.startswith("http_")},
                loop_max_lag_ms=m["c1"]["loop_max_lag_ms"],
                gc2_max_ms=m["c1"]["gc2_max_ms"],
                gc2_n=m["c1"]["gc2_n"],
                generate_p50_ms=m["c1"]["generate_p50_ms"],
                generate_p99_ms=m["c1"]["generate_p99_ms"],
                generate_max_ms=m["c1"]["generate_max_ms"],
                cpu_share_of={k: (m["others1"][k] - m["others0"][k]) / (m["t1"] - m["t0"]) for k in others},
            )
            results[phase] = r
            print(f"{phase}: " + json.dumps(r), flush=True)
        print(
            "\n| phase | sessions/s | turn p50 ms | turn p99 ms | turn max ms | generate p99 ms | server loop"
            " max lag ms | gen-2 GC max ms | server CPU (cores) | CPU ms/session | RSS idle→peak MiB"
            " | KiB/open session | errors |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for phase, r in results.items():
            print(
                f"| {phase} | {r['sessions_per_s']:.0f} | {r['turn_p50_ms']:.0f} | {r['turn_p99_ms']:.0f} | "
                f"{r['turn_max_ms']:.0f} | {r['generate_p99_ms']:.0f} | {r['loop_max_lag_ms']:.0f} | "
                f"{r['gc2_max_ms']:.0f} | {r['server_cpu_share']:.2f} | {r['server_cpu_ms_per_session']:.2f} | "
                f"{r['rss_idle_mib']:.0f}→{r['rss_peak_mib']:.0f} | {r['rss_kib_per_open_session']:.1f} | "
                f"{r['errors']} |"
            )
        print(f"attacked: the server refused {results['attacked']['refused']}")
        for phase, r in results.items():
            print(
                f"{phase}: CPU (cores) of the serving process {r['server_cpu_share']:.2f}, "
                + ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_share_of"].items())
            )
    finally:
        for p in reversed(procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        farm.close()


if __name__ == "__main__":
    main()
