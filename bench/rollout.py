"""The rollout plane through actors, as the recipe runs it, beside AReaL 1.0.4's client, on sim servers.

Ours: an embedded ``rlactors.init()`` cluster with a GovernorActor, a BufferActor and N RolloutActors
(each a process, sharding the prompt source and, with ``--shard-servers``, the servers), and a driver
loop that does what recipes/gsm8k_grpo.py does with the trainer taken out: ``buffer.get_batch`` ->
every ``--pause-every`` steps the publish sequence as nodes/driver/policy_sync.py does it (rollouts
``pause`` -> servers ``/pause_generation`` (abort) -> [``--push-s``] -> governor and rollouts
``set_version`` -> rollouts ``resume``, which returns once each server with held requests has one
re-posted, held by the paused server -> ``/continue_generation``; ``--orders continue-first`` continues
before ``set_version``, AReaL's order), else the version bump alone. AReaL (``--areal PYTHON``): bench/areal_client.py
in its own venv, same servers, prompts, K, max new tokens, batch, eta, concurrency and pauses.
``--bare``: the servers' capacity, a bare aiohttp loop posting the same requests with no pauses
(a variant below its calls/s was not held back by the servers). ``--pin CLIENT:FARM``: CPU sets for
the client side (driver, the plane's actors, AReaL's tree, the bare loop) and the sim servers.
Variants run one after another in each repeat, on the same servers (bench/simfarm.py: many sim
servers per process).

Measured after ``--warmup-steps`` batches, for ``--seconds``:
- calls/s: ``/generate`` requests the servers received (counted server-side, the same for both);
- client CPU per call: CPU time of the plane's processes (rollout actors + governor + buffer) per
  call; also the driver and runtime daemons, reported apart; for AReaL its whole process tree
  (trainer loop, executor thread, reward process pool);
- resume gap: ``/continue_generation`` -> the server's first step with a request to run (median,
  max; server-side, bench/simfarm.py): how long a continued server sits idle;
- cached share: prefix tokens of resumed requests (input = an aborted request's tokens) served
  from the server's cache; requests in flight (server-side, max over steps, and the farm-wide peak
  from bench/simfarm.py's per-process counts: ``farm_inflight_peak``, lower and upper bound);
  staleness max; errors;
- around the resume (printed under each row): the driver's continue fan-out, the time between it
  and the resume RPCs, the resume call -> ``resume()`` in each rollout actor, and ``resume()`` ->
  the first, every server's first, and the last held request re-posted (the client's ``reposts``).

    python bench/rollout.py --servers 16 --actors 1 2 --areal /tmp/areal14/V/bin/python
    python bench/rollout.py --servers 64 --batch 1024 --eta 1 --concurrency 4096 --n-samples 1   # the stall
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from simfarm import Farm, flush_caches, probe_stats  # bench/simfarm.py, beside this script

import rlactors
from nodes.plane.buffer import BufferActor, BufferConfig
from nodes.plane.governor import GovernorActor, GovernorConfig
from nodes.rollout.actor import RolloutActor
from nodes.rollout.config import ClientConfig, RolloutConfig
from nodes.rollout.prompts import arithmetic_items
from nodes.rollout.reward import RewardConfig
from nodes.rollout.workflows import ByteChatTokenizer, RLVRConfig, RLVRWorkflow, WorkflowSpec
from rlactors.base.aio import wait_for

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "RESULTS.md"


def cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of these processes (and their live children)."""
    total = 0.0
    for pid in pids:
        try:
            p = psutil.Process(pid)
            for q in [p, *p.children(recursive=True)]:
                t = q.cpu_times()
                total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


class Sampler:
    """Server-side counters between ``start`` and ``stop``, and requests in flight per step."""

    def __init__(self, urls: list[str], farm_pids: list[int]) -> None:
        self.urls, self.farm_pids, self.inflight = urls, farm_pids, 0

    async def start(self) -> None:
        await probe_stats(self.urls, reset=True)
        self.t, self.farm_cpu = time.monotonic(), cpu_s(self.farm_pids)

    async def sample(self) -> None:
        self.inflight = max(self.inflight, (await probe_stats(self.urls))["inflight"])

    async def stop(self) -> dict[str, Any]:
        wall, farm_cpu = time.monotonic() - self.t, cpu_s(self.farm_pids) - self.farm_cpu
        s = await probe_stats(self.urls)
        gaps = s["gaps"]
        return {
            "wall_s": wall,
            "calls": s["generates"],
            "calls_per_s": s["generates"] / wall,
            "farm_us_per_call": 1e6 * farm_cpu / max(1, s["generates"]),
            "farm_cores": farm_cpu / wall,
            "gap_ms_median": 1e3 * statistics.median(gaps) if gaps else float("nan"),
            "gap_ms_max": 1e3 * max(gaps) if gaps else float("nan"),
            "pauses_seen": len(gaps),
            "farm_gap_ms_p90_p99": [
                round(1e3 * gaps[min(len(gaps) - 1, int(q * len(gaps)))], 1) for q in (0.9, 0.99)
            ]
            if gaps
            else None,
            "farm_gaps_over_50ms": sum(g > 0.05 for g in gaps),
            # of those, servers that continued with no re-post queued (the rest had one: the
            # server's own process was late to run it), and the longest gap of such a server
            "farm_gaps_over_50ms_nothing_queued": sum(g > 0.05 for g in s["idle_gaps"]),
            "farm_gap_ms_max_nothing_queued": round(1e3 * max(s["idle_gaps"], default=0.0), 1),
            "resumed": s["resumed"],
            "cached_share": s["resumed_cached"] / max(1, s["resumed_prefix"]),
            "requests_inflight_max": max(self.inflight, s["inflight"]),
            "farm_inflight_peak": s["farm_inflight_peak"],
            "farm_inflight_hwm_sum": s["farm_inflight_hwm_sum"],
        }


async def servers_post(
    session: aiohttp.ClientSession, urls: list[str], path: str, body: dict[str, Any]
) -> None:
    async def one(u: str) -> None:
        async with session.post(u + path, json=body) as r:
            r.raise_for_status()

    await asyncio.gather(*(one(u) for u in urls))


def driver_cpu_s(exclude: list[int]) -> float:
    """CPU of this process and its children (the embedded cluster's daemons), less ``exclude``'s trees."""
    return cpu_s([os.getpid()]) - cpu_s(exclude)


def own_cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of these processes alone (not their children)."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
    return total


def daemons(exclude: list[int]) -> dict[str, int]:
    """This process's children outside ``exclude``'s trees (the embedded cluster's daemons), by name."""
    skip = set(exclude)
    for pid in exclude:
        with contextlib.suppress(psutil.NoSuchProcess):
            skip.update(q.pid for q in psutil.Process(pid).children(recursive=True))
    out = {}
    for q in psutil.Process().children(recursive=True):
        if q.pid not in skip:
            with contextlib.suppress(psutil.NoSuchProcess):
                out[f"daemon-{q.pid}-{q.name()}"] = q.pid
    return out


class Profiler:
    """py-spy on each named process for the measured window: collapsed stacks in ``out_dir``, and
    per process the functions that held most samples (own time, and inclusive). Samples only while
    a thread holds the GIL (``--gil``): Python's CPU, not an event loop waiting in epoll."""

    def __init__(self, out_dir: str | None, seconds: float) -> None:
        self.out_dir, self.seconds = out_dir, seconds
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.files: dict[str, Path] = {}

    def start(self, variant: str, pids: dict[str, int], subprocesses: bool = False) -> None:
        spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
        if spy is None:
            raise SystemExit("--profile needs py-spy: pip install 'rlactors[bench]'")
        Path(self.out_dir).mkdir(parents=True, exist_ok=True)
        for name, pid in pids.items():
            f = Path(self.out_dir) / f"{variant}-{name}.txt"
            argv = [
                spy,
                "record",
                "--pid",
                str(pid),
                "--duration",
                str(max(1, int(self.seconds))),
                "--rate",
                "200",
                "--nonblocking",
                "--gil",
                "--format",
                "raw",
                "--output",
                str(f),
                *(["--subprocesses"] * subprocesses),
            ]
            self.files[name] = f
            self.procs[name] = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def finish(self) -> dict[str, Any]:
        out = {}
        for name, p in self.procs.items():
            await asyncio.to_thread(p.wait, self.seconds + 60)  # py-spy ends after its --duration
            if self.files[name].exists():
                out[name] = top_functions(self.files[name].read_text())
        return out


def top_functions(collapsed: str, n: int = 8) -> dict[str, Any]:
    """From py-spy's collapsed stacks: samples, and the ``n`` functions with most own and most
    inclusive samples (each as a percentage of the process's samples)."""
    own: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        k = int(count)
        total += k
        frames = [
            f.split(" (")[0] + " " + f.rsplit("/", 1)[-1].split(":")[0].rstrip(")") for f in stack.split(";")
        ]
        own[frames[-1]] = own.get(frames[-1], 0) + k
        for f in set(frames):
            incl[f] = incl.get(f, 0) + k

    def pct(d: dict[str, int]) -> list[list[Any]]:
        return [
            [f, round(100 * v / max(1, total), 1)] for f, v in sorted(d.items(), key=lambda kv: -kv[1])[:n]
        ]

    return {"samples": total, "own": pct(own), "inclusive": pct(incl)}


async def ours(
    urls: list[str], a: argparse.Namespace, n_actors: int, farm_pids: list[int], continue_first: bool = False
) -> dict[str, Any]:
    """The plane through actors, driven as the recipe drives it."""
    B, K, eta, C = a.batch, a.n_samples, a.eta, a.concurrency
    prompts = {"kind": "arithmetic", "n": a.prompts, "epochs": None, "shuffle": True}
    reward = RewardConfig(fn="cpu_reward:burn_reward") if a.reward_us else RewardConfig()
    wf = WorkflowSpec(reward=reward, config=RLVRConfig(n_samples=K, max_new_tokens=a.max_new_tokens))
    per_actor = -(-C // n_actors)
    cfg = RolloutConfig(
        n_actors=n_actors,
        max_inflight=per_actor,
        acquire_batch=min(per_actor, a.acquire_batch),
        client=ClientConfig(max_connections_per_server=a.connections),
    )
    async with rlactors.init() as cluster, aiohttp.ClientSession() as http:
        gov = await cluster.spawn(GovernorActor, GovernorConfig(B, eta, C), name="governor")
        buf = await cluster.spawn(BufferActor, gov, BufferConfig(max_staleness=eta), name="buffer")
        rollouts = []
        for i in range(n_actors):
            mine = urls[i::n_actors] if a.shard_servers and len(urls) >= n_actors else urls
            rollouts.append(
                await cluster.spawn(
                    RolloutActor,
                    mine,
                    gov,
                    buf,
                    prompts,
                    wf,
                    config=cfg,
                    shard=i,
                    num_shards=n_actors,
                    name=f"rollout-{i}",
                )
            )
        actors = {x["name"]: x["pid"] for x in await cluster.actors()}
        plane = [actors["governor"], actors["buffer"], *(actors[f"rollout-{i}"] for i in range(n_actors))]
        sampler = Sampler(urls, farm_pids)
        version, staleness, in_flight = 0, 0, 0
        pauses: list[dict[str, Any]] = []  # driver's times (monotonic) per pause, to split the resume gap

        async def step() -> None:
            nonlocal version, staleness, in_flight
            batch = await buf.get_batch(B, version, a.batch_timeout)
            staleness = max(staleness, batch.max_staleness)
            in_flight = max(in_flight, (await buf.stats())["in_flight"])
            if a.pause_every and version % a.pause_every == 0:  # PolicySync.publish, no weights
                await asyncio.gather(*(r.pause() for r in rollouts))
                await servers_post(http, urls, "/pause_generation", {"mode": "abort"})
                await asyncio.sleep(a.push_s)  # the weight push
                p: dict[str, Any] = {"measured": sampler_started}
                if continue_first:  # AReaL's order (and ours before): continue, then re-post
                    p["cont0"] = time.monotonic()
                    await servers_post(http, urls, "/continue_generation", {})
                    p["cont1"] = time.monotonic()
                await asyncio.gather(
                    gov.set_version(version + 1), *(r.set_version(version + 1) for r in rollouts)
                )
                p["res0"] = time.monotonic()
                await asyncio.gather(*(r.resume() for r in rollouts))
                p["res1"] = time.monotonic()
                if not continue_first:  # PolicySync's: re-post to the paused servers, then continue
                    p["cont0"] = time.monotonic()
                    await servers_post(http, urls, "/continue_generation", {})
                    p["cont1"] = time.monotonic()
                pauses.append(p)
            else:
                await gov.set_version(version + 1)
                await asyncio.gather(*(r.set_version(version + 1) for r in rollouts))
            version += 1

        sampler_started = False
        for _ in range(a.warmup_steps):
            await step()
        await sampler.start()
        sampler_started = True
        # the driver's share: this process and the runtime's daemons, found before the window (a scan
        # of /proc costs the scanning process a lot on a busy machine), each counted without children
        driver = {"driver": os.getpid(), **daemons(exclude=[*plane, *farm_pids])}
        spies = Profiler(a.profile, a.seconds)
        if a.profile:  # the whole tree: the plane, the driver and the runtime's daemons
            spies.start(f"ours-{n_actors}", {**{n: actors[n] for n in actors}, **driver})
        cpu0, drv0 = [cpu_s([p]) for p in plane], own_cpu_s(list(driver.values()))
        sampling = asyncio.create_task(_sample_every(sampler, 1.0))
        steps = 0
        while time.monotonic() - sampler.t < a.seconds:
            await step()
            steps += 1
        sampling.cancel()
        out = await sampler.stop()
        cpu1, drv1 = [cpu_s([p]) for p in plane], own_cpu_s(list(driver.values()))
        profile = await spies.finish()
        stats = await asyncio.gather(*(r.stats() for r in rollouts))
        bstats = await buf.stats()
        for r in rollouts:
            await r.stop()
    calls = max(1, out["calls"])
    cpu = [b - c for b, c in zip(cpu1, cpu0, strict=True)]
    kinds = ("client_errors", "client_retries", "client_failovers", "episodes_failed")
    error_split = {k: sum(s[k] for s in stats) for k in kinds}
    errors = sum(error_split.values())
    variant = f"ours, {n_actors} rollout actor{'s' if n_actors > 1 else ''}" + (
        ", continue first" * continue_first
    )
    return {
        **out,
        "variant": variant,
        "steps": steps,
        "cpu_us_per_call": 1e6 * sum(cpu) / calls,
        "rollout_us_per_call": 1e6 * sum(cpu[2:]) / calls,
        "buffer_us_per_call": 1e6 * cpu[1] / calls,
        "governor_us_per_call": 1e6 * cpu[0] / calls,
        "driver_us_per_call": 1e6 * (drv1 - drv0) / calls,
        "staleness_max": staleness,
        "errors": errors,
        "tree_us_per_call": 1e6 * (sum(cpu) + drv1 - drv0) / calls,
        **({"profile": profile} if profile else {}),
        "episodes_inflight_max": in_flight,
        **({"errors_split": error_split} if errors else {}),
        "dropped_stale": bstats["dropped_stale"],
        "failures": [s["failure"] for s in stats if s.get("failure")],
        "rollout_loop_lag_max_s": [round(s["loop_lag_max_s"], 2) for s in stats],
        **resume_split(pauses, [s["resume_reposts"] for s in stats]),
    }


def resume_split(pauses: list[dict[str, Any]], reposts: list[list[list[float]]]) -> dict[str, Any]:
    """Where the time around a resume goes, per measured pause (medians / maxima over pauses and
    actors, ms): the driver's /continue_generation fan-out; between it and the resume RPCs (continue
    end -> resume call under ``--orders continue-first``, else resume returned -> continue start); the
    resume call -> resume() running in the actor; resume() -> the first and the last held request
    re-posted, and until every server with held requests had its first (client-side)."""
    rows = []
    for actor in reposts:
        for p, r in zip(pauses[-len(actor) :] if actor else [], actor, strict=True):
            if p["measured"]:
                between = p["res0"] - p["cont1"] if p["cont0"] < p["res0"] else p["cont0"] - p["res1"]
                rows.append(
                    (
                        1e3 * (p["cont1"] - p["cont0"]),
                        1e3 * between,
                        1e3 * (r[0] - p["res0"]),
                        r[1],
                        r[4],
                        r[2],
                        r[3],
                    )
                )
    if not rows:
        return {}
    cols = list(zip(*rows, strict=True))
    keys = (
        "continue_fanout",
        "between_continue_and_resume",
        "resume_call_to_actor",
        "resume_to_first_repost",
        "resume_to_every_server_reposted",
        "resume_to_last_repost",
    )
    out = {
        f"{k}_ms": (round(statistics.median(c), 1), round(max(c), 1))
        for k, c in zip(keys, cols, strict=False)
    }
    out["reposts_per_resume"] = (statistics.median(cols[6]), max(cols[6]))
    return out


def prompt_ids(n: int) -> list[dict[str, Any]]:
    """The plane's first ``n`` prompts as the servers see them (our byte tokenizer's chat ids), with answers."""
    wf = RLVRWorkflow(ByteChatTokenizer(), lambda *_: 0.0)
    from nodes.rollout.workflows import chat_ids

    return [
        {"input_ids": chat_ids(wf.tokenizer, wf.prompt_messages(it)), "answer": it["answer"].split()[-1]}
        for it in arithmetic_items(n)
    ]


def areal_spec(urls: list[str], a: argparse.Namespace) -> str:
    """The same prompts, K, tokens, batch, eta and concurrency, as JSON."""
    spec = {
        "urls": urls,
        "prompts": prompt_ids(a.prompts),
        "n_samples": a.n_samples,
        "max_new_tokens": a.max_new_tokens,
        "batch_size": a.batch,
        "max_staleness": a.eta,
        "max_concurrent": a.concurrency,
        "pause_every": a.pause_every,
        "push_s": a.push_s,
        "warmup_steps": a.warmup_steps,
        "seconds": a.seconds,
    }
    path = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump(spec, path)
    path.close()
    return path.name


async def areal(urls: list[str], a: argparse.Namespace, farm_pids: list[int]) -> dict[str, Any]:
    """bench/areal_client.py in AReaL's venv; CPU of its whole process tree between 'warm' and 'done'."""
    spec = areal_spec(urls, a)
    run_dir = tempfile.mkdtemp(prefix="areal-run-")  # AReaL must not run where a folder is named 'ray'
    log = open(Path(run_dir) / "stderr.log", "w+")  # noqa: ASYNC230 (one file, before anything runs)
    proc = await asyncio.create_subprocess_exec(
        a.areal,
        str(ROOT / "bench" / "areal_client.py"),
        "--spec",
        spec,
        cwd=run_dir,
        stdout=asyncio.subprocess.PIPE,
        stderr=log,
    )
    sampler = Sampler(urls, farm_pids)
    result: dict[str, Any] = {}
    try:

        async def lines() -> Any:
            while line := await wait_for(proc.stdout.readline(), a.batch_timeout * 3):
                yield line.decode().strip()

        async for line in lines():
            if line == "warm":
                await sampler.start()
                cpu0 = cpu_s([proc.pid])
                sampling = asyncio.create_task(_sample_every(sampler, 1.0))
                spies = Profiler(a.profile, a.seconds)
                if a.profile:
                    spies.start("areal", {"areal": proc.pid}, subprocesses=True)
            elif line.startswith("done "):
                cpu1 = cpu_s([proc.pid])
                sampling.cancel()
                out = await sampler.stop()
                result = {**out, **json.loads(line[5:])}
                result["cpu_us_per_call"] = result["tree_us_per_call"] = (
                    1e6 * (cpu1 - cpu0) / max(1, out["calls"])
                )
                if a.profile:
                    result["profile"] = await spies.finish()
                break
        await wait_for(proc.wait(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        os.unlink(spec)
    log.seek(0)
    err = log.read()
    log.close()
    if not result:
        raise RuntimeError(f"AReaL adapter failed (exit {proc.returncode}):\n{err[-3000:]}")
    result["errors"] = sum(1 for ln in err.splitlines() if "error" in ln.lower() or "retry" in ln.lower())
    result["variant"] = "AReaL 1.0.4"
    return result


async def bare(urls: list[str], a: argparse.Namespace, farm_pids: list[int]) -> dict[str, Any]:
    """The servers' capacity: ``--concurrency`` loops in this process, each posting the plane's
    requests (same prompts, one sample, same max new tokens) one after another to the next server,
    aiohttp + orjson, no pauses and no plane. Calls/s here is what the servers give the cheapest
    client on these CPUs, once the loops keep them busy (check ``farm_cores``: with few loops it is
    bound by the requests' latency instead); a variant below it was not held back by the servers."""
    import orjson

    params = {"max_new_tokens": a.max_new_tokens, "temperature": 1.0}
    bodies = [
        orjson.dumps({"input_ids": p["input_ids"], "sampling_params": params, "return_logprob": True})
        for p in prompt_ids(min(a.prompts, 1024))
    ]
    errors = 0
    conn = aiohttp.TCPConnector(limit=0, limit_per_host=a.connections)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def loop(i: int) -> None:
            nonlocal errors
            k = i
            while True:
                k += a.concurrency
                try:
                    async with session.post(
                        urls[k % len(urls)] + "/generate",
                        data=bodies[k % len(bodies)],
                        headers={"Content-Type": "application/json"},
                    ) as r:
                        body = await r.read()
                    if r.status == 200:
                        orjson.loads(body)  # as a client would: the answer parsed
                    else:
                        errors += 1
                except aiohttp.ClientError:
                    errors += 1

        tasks = [asyncio.create_task(loop(i)) for i in range(a.concurrency)]
        try:
            await asyncio.sleep(2.0)  # warm-up: connections open, the servers' queues full
            sampler = Sampler(urls, farm_pids)
            await sampler.start()
            cpu0 = driver_cpu_s(exclude=farm_pids)  # the farm's processes are this one's children
            sampling = asyncio.create_task(_sample_every(sampler, 1.0))
            await asyncio.sleep(a.seconds)
            cpu1 = driver_cpu_s(exclude=farm_pids)
            sampling.cancel()
            out = await sampler.stop()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return {
        **out,
        "cpu_us_per_call": 1e6 * (cpu1 - cpu0) / max(1, out["calls"]),
        "errors": errors,
        "staleness_max": "-",
        "variant": "bare aiohttp loop (the servers' capacity)",
    }


async def _sample_every(sampler: Sampler, period: float) -> None:
    while True:
        await asyncio.sleep(period)  # AReaL's steps run in its process: sample server load on a clock
        await sampler.sample()


def row(r: dict[str, Any]) -> str:
    parts = (
        f"{r['rollout_us_per_call']:.0f} / {r['buffer_us_per_call']:.0f} / {r['governor_us_per_call']:.0f}"
        if "rollout_us_per_call" in r
        else "-"
    )
    drv = f"{r['driver_us_per_call']:.0f}" if "driver_us_per_call" in r else "(in the tree)"
    tree = f"{r['tree_us_per_call']:.0f}" if "tree_us_per_call" in r else "-"
    return (
        f"| {r['variant']} | {r['calls_per_s']:.0f} | {r['cpu_us_per_call']:.0f} | {parts} | {drv} | "
        f"{tree} | {r['calls']} | "
        f"{r['gap_ms_median']:.1f} / {r['gap_ms_max']:.1f} | {100 * r['cached_share']:.1f}% ({r['resumed']}) | "
        f"{r['requests_inflight_max']} | {r['staleness_max']} | {r['errors']} |"
    )


HEADER = (
    "| variant | calls/s | client CPU/call, µs | rollout / buffer / governor µs | driver + runtime µs |"
    " whole tree µs/call | calls | resume gap ms (median / max) | cached share of resumed prefixes (requests)"
    " | requests in flight (max) | staleness max | errors |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", type=int, default=16)
    ap.add_argument("--farm-procs", type=int, default=2, help="processes serving the sim servers")
    ap.add_argument(
        "--actors",
        type=int,
        nargs="*",
        default=[1],
        help="rollout actor counts to run (none: only --areal, --bare)",
    )
    ap.add_argument("--shard-servers", action="store_true", help="actor i uses servers i, i+N, ...")
    ap.add_argument("--areal", help="python of AReaL 1.0.4's venv: run its client too")
    ap.add_argument("--bare", action="store_true", help="also a bare client loop: the servers' capacity")
    ap.add_argument("--batch", type=int, default=32, help="groups per step (B)")
    ap.add_argument("--n-samples", type=int, default=4, help="K")
    ap.add_argument("--eta", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=256, help="episodes (groups) running at once")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=4096)
    ap.add_argument("--acquire-batch", type=int, default=256)
    ap.add_argument("--connections", type=int, default=1024, help="per server, per rollout actor")
    ap.add_argument("--pause-every", type=int, default=1, help="steps per pause (0: version bumps only)")
    ap.add_argument("--push-s", type=float, default=0.0, help="a weight push's time: pause -> continue")
    ap.add_argument(
        "--orders",
        nargs="+",
        default=["resume-first"],
        choices=["resume-first", "continue-first"],
        help="ours: re-post to paused servers, then continue (PolicySync), or continue first "
        "(AReaL's order; ours before); several run interleaved",
    )
    ap.add_argument(
        "--pin",
        metavar="CLIENT:FARM",
        help="CPU sets, e.g. 0:1: the client (driver, plane or AReaL's "
        "tree) on the first, the sim servers on the second, so each side's rate is its own",
    )
    ap.add_argument(
        "--reward-us",
        type=int,
        default=0,
        help="ours: each reward call burns this much CPU "
        "(bench/cpu_reward.py), as a costly checker does; AReaL's adapter is not changed",
    )
    ap.add_argument("--decode-s", type=float, default=0.01, help="sim server seconds per decode step")
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument(
        "--profile",
        metavar="DIR",
        help="py-spy each client process over the measured window (--nonblocking, "
        "its own CPU not counted); collapsed stacks in DIR, the top functions per process printed",
    )
    ap.add_argument("--batch-timeout", type=float, default=120.0)
    ap.add_argument(
        "--write", metavar="TITLE", help="append the table to bench/RESULTS.md under this heading"
    )
    a = ap.parse_args()
    os.environ["RLACTORS_BENCH_REWARD_US"] = str(a.reward_us)  # the cluster's workers inherit it

    server_argv = [
        "--backend",
        "sim",
        "--sim-decode-s-base",
        str(a.decode_s),
        "--max-running-requests",
        "16384",
    ]
    farm = Farm(a.servers, a.farm_procs, server_argv)
    results: list[dict[str, Any]] = []
    try:
        farm.wait_ready()
        if a.pin:  # children inherit affinity: the cluster's daemons and actors, AReaL's tree
            client_cpus, farm_cpus = ({int(c) for c in part.split(",")} for part in a.pin.split(":"))
            for pid in farm.pids():
                for q in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
                    q.cpu_affinity(sorted(farm_cpus))
            os.sched_setaffinity(0, client_cpus)
        for rep in range(a.repeats):
            ours_ = [("ours", n, o == "continue-first") for n in a.actors for o in a.orders]
            others = [(kind, 0, False) for kind, on in (("areal", a.areal), ("bare", a.bare)) if on]
            for kind, n_actors, continue_first in [*ours_, *others]:
                t = time.monotonic()
                asyncio.run(flush_caches(farm.urls))  # every variant starts on empty caches
                if kind == "ours":
                    r = asyncio.run(ours(farm.urls, a, n_actors, farm.pids(), continue_first))
                else:
                    r = asyncio.run((areal if kind == "areal" else bare)(farm.urls, a, farm.pids()))
                r["repeat"] = rep
                results.append(r)
                print(row(r), f"({time.monotonic() - t:.0f} s)", flush=True)
                extra = {
                    k: v
                    for k, v in r.items()
                    if k.startswith(
                        ("farm_", "continue_", "resume_", "reposts_", "errors_", "pauses_", "rollout_loop")
                    )
                }
                cores = {
                    "client_cores": round(r["cpu_us_per_call"] * r["calls_per_s"] / 1e6, 2),
                    "tree_us_per_call": round(r.get("tree_us_per_call", r["cpu_us_per_call"])),
                }
                for proc_name, top in r.get("profile", {}).items():
                    print(f"    profile {proc_name}: {json.dumps(top)}", flush=True)
                print("   ", json.dumps({**extra, **cores, "errors": r["errors"]}), flush=True)
    finally:
        farm.close()
    cmd = "python bench/rollout.py " + " ".join(sys.argv[1:])
    text = "\n".join(
        [
            f"Command: `{cmd}`. Machine: {platform.machine()}, {os.cpu_count()} cores (shared with the sim servers,"
            f" {a.farm_procs} processes), Python {platform.python_version()}, 1-min load {os.getloadavg()[0]:.1f} at end,"
            f" {time.strftime('%Y-%m-%d')}. {a.servers} sim servers ({a.decode_s * 1e3:.0f} ms per decode step), B={a.batch},"
            f" K={a.n_samples}, eta={a.eta}, {a.concurrency} episodes at once, {a.max_new_tokens} new tokens, pause every"
            f" {a.pause_every} step(s), {a.push_s} s from pause to continue.",
            "",
            HEADER,
            *map(row, results),
            "",
        ]
    )
    print(text)
    print(json.dumps(results, default=str), file=sys.stderr)
    if a.write:
        RESULTS.write_text(RESULTS.read_text().rstrip("\n") + f"\n\n#### {a.write}\n\n" + text)


if __name__ == "__main__":
    main()
