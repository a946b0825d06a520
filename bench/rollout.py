"""Rollout-plane benchmark with sim servers, against a baseline measured in the same run.

1. Baseline: a bare asyncio httpx loop (pooled connections, same concurrency, same request
   shape) posting ``/generate`` to the same servers: calls/s and client CPU per call.
2. The rollout plane in one process: Rollout core + SGLangClient + governor + buffer + a
   trainer loop that takes batches, bumps the version and, every few steps, pauses the
   servers (abort) for a "weight update": generate calls/s, episodes/s, client CPU per call,
   aborts, resumes, and the share of resumed prefixes served from cache.
3. Governor grants/s: the plain core (acquire + finish cycles), and through the runtime
   (GovernorActor, batched acquire of 64 + a finish tell).

    python bench/rollout.py                       # 16 servers, 2048 concurrent episodes, writes RESULTS.md
    python bench/rollout.py --servers 4 --episodes 512 --seconds 10 --no-write
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nodes.buffer import BufferConfig, TrajectoryBuffer  # noqa: E402
from nodes.governor import GovernorConfig, StalenessGovernor  # noqa: E402
from nodes.inference.testing import start_reference_server, stop_server  # noqa: E402
from nodes.rollout.actor import Rollout, RolloutConfig  # noqa: E402
from nodes.rollout.client import ClientConfig, SGLangClient  # noqa: E402
from nodes.rollout.prompts import prompt_source  # noqa: E402
from nodes.rollout.workflows import RLVRConfig, WorkflowSpec, build_workflow  # noqa: E402

RESULTS = ROOT / "bench" / "RESULTS.md"
NEW_TOKENS = 16
SERVER_ARGS = ["--backend", "sim", "--sim-decode-s-base", "0.01", "--max-running-requests", "4096"]


async def baseline(urls: list[str], concurrency: int, seconds: float, per_client: int) -> dict[str, float]:
    """Bare httpx: ``concurrency`` loops each posting a 1-sample request, spread over the servers,
    through AsyncClients of ``per_client`` connections each (one client per server when huge)."""
    n_clients = max(len(urls), concurrency // per_client)
    clients = [httpx.AsyncClient(base_url=urls[i % len(urls)], timeout=600,
                                 limits=httpx.Limits(max_connections=per_client, max_keepalive_connections=per_client))
               for i in range(n_clients)]  # fmt: skip
    calls = 0
    stop = time.monotonic() + seconds
    prompt = list(b"<user>What is 12 + 30?<eos>\n<assistant>")

    async def loop(i: int) -> None:
        nonlocal calls
        c = clients[i % len(clients)]  # loop i -> server i % len(urls): even spread
        while time.monotonic() < stop:
            r = await c.post("/generate", json={"input_ids": prompt, "rid": f"b{i}-{calls}", "return_logprob": True,
                                                "sampling_params": {"max_new_tokens": NEW_TOKENS}})  # fmt: skip
            r.json()
            calls += 1

    cpu, t = time.process_time(), time.monotonic()
    await asyncio.gather(*(loop(i) for i in range(concurrency)))
    wall, cpu = time.monotonic() - t, time.process_time() - cpu
    for c in clients:
        await c.aclose()
    return {"calls_per_s": calls / wall, "cpu_us_per_call": 1e6 * cpu / max(calls, 1), "calls": calls}


async def plane(urls: list[str], episodes: int, seconds: float, pause_every: int) -> dict[str, float]:
    """The rollout plane with a no-op trainer that pauses the servers every ``pause_every`` steps."""
    B, eta = max(1, episodes // 4), 3  # (eta + 1) * B == episodes: capacity allows them all in flight
    gov = StalenessGovernor(GovernorConfig(B, eta, max_concurrent=episodes))
    buf = TrajectoryBuffer(BufferConfig(max_staleness=eta, order="arrival"), governor=gov)
    client = SGLangClient(urls, ClientConfig(max_connections_per_server=4096))
    wf = build_workflow(
        WorkflowSpec(config=RLVRConfig(n_samples=1, sampling_params={"max_new_tokens": NEW_TOKENS}))
    )
    rollout = Rollout("bench", client, wf, prompt_source({"kind": "arithmetic", "n": 1000, "epochs": None}), gov, buf,
                      RolloutConfig(max_inflight=episodes, acquire_batch=256))  # fmt: skip
    admins = [httpx.AsyncClient(base_url=u, timeout=60) for u in urls]
    run = asyncio.create_task(rollout.run())
    version, pauses = 0, 0
    cpu, t = time.process_time(), time.monotonic()
    while time.monotonic() - t < seconds:
        await buf.get_batch(B, version, timeout=120)
        if pause_every and version % pause_every == pause_every - 1:
            rollout.pause()
            await asyncio.gather(*(a.post("/pause_generation", json={"mode": "abort"}) for a in admins))
            await asyncio.gather(*(a.post("/continue_generation", json={}) for a in admins))
            rollout.set_version(version + 1)
            rollout.resume()
            pauses += 1
        version += 1
        gov.set_version(version)
    wall, cpu = time.monotonic() - t, time.process_time() - cpu
    s = rollout.stats()
    await rollout.stop()
    run.cancel()
    await asyncio.gather(run, return_exceptions=True)
    await client.aclose()
    for a in admins:
        await a.aclose()
    posts = s["client_posts"]
    resumed_posts = s["client_resumes"]
    return {
        "calls_per_s": posts / wall, "cpu_us_per_call": 1e6 * cpu / max(posts, 1), "calls": posts,
        "episodes_per_s": s["episodes_done"] / wall, "aborts": s["client_aborts"], "resumes": resumed_posts,
        "pauses": pauses, "versions": version, "dropped_stale": buf.stats()["dropped_stale"],
        "cached_tokens": s["client_cached_tokens"],
    }  # fmt: skip


def governor_core_grants_per_s(n: int = 200_000) -> float:
    gov = StalenessGovernor(GovernorConfig(batch_size=1 << 30, max_staleness=0, max_concurrent=1 << 30))
    t = time.perf_counter()
    for _ in range(n // 64):
        gov.try_acquire("h", 64)
        gov.finish("h", k_rejected=64)
    return n / (time.perf_counter() - t)


async def governor_actor_grants_per_s(seconds: float = 5.0) -> float:
    import rlactors
    from nodes.governor import GovernorActor

    async with rlactors.init() as cluster:
        gov = await cluster.spawn(GovernorActor, GovernorConfig(1 << 30, 0, 1 << 30))
        granted, t = 0, time.monotonic()
        while time.monotonic() - t < seconds:
            g = await gov.acquire("h", 64, 5.0)
            gov.finish.tell("h", 0, g.n)
            granted += g.n
        return granted / (time.monotonic() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", type=int, default=16)
    ap.add_argument("--episodes", type=int, default=2048)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--pause-every", type=int, default=4)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()

    with ThreadPoolExecutor(args.servers) as pool:
        started = list(pool.map(lambda _: start_reference_server(SERVER_ARGS), range(args.servers)))
    urls = [u for _, u in started]
    try:
        natural = asyncio.run(baseline(urls, args.episodes, args.seconds, per_client=1 << 20))
        base = asyncio.run(baseline(urls, args.episodes, args.seconds, per_client=4))
        ours = asyncio.run(plane(urls, args.episodes, args.seconds, args.pause_every))
    finally:
        for proc, _ in started:
            stop_server(proc)
    core = governor_core_grants_per_s()
    actor = asyncio.run(governor_actor_grants_per_s())
    load = os.getloadavg()[0]
    lines = [
        "## Rollout",
        "",
        f"Command: `python bench/rollout.py --servers {args.servers} --episodes {args.episodes} --seconds {args.seconds}"
        f" --pause-every {args.pause_every}`. Machine: {platform.machine()}, {os.cpu_count()} cores (shared with the"
        f" {args.servers} sim server processes), Python {platform.python_version()}, 1-min load {load:.1f} at end."
        f" Date: {time.strftime('%Y-%m-%d')}. Sim servers: 10 ms per decode step, {NEW_TOKENS} new tokens per request;"
        " client CPU is the bench process's CPU time per /generate post (governor, buffer and trainer loop included"
        " for the plane).",
        "",
        "| what | bare httpx loop, one pooled AsyncClient per server | bare httpx loop, 4-connection"
        " AsyncClients (the client's lane layout) | rollout plane | plane / bare 4-conn |",
        "| --- | --- | --- | --- | --- |",
        f"| /generate calls/s | {natural['calls_per_s']:.0f} | {base['calls_per_s']:.0f} | {ours['calls_per_s']:.0f} |"
        f" {ours['calls_per_s'] / base['calls_per_s']:.2f}x |",
        f"| client CPU per call | {natural['cpu_us_per_call']:.0f} µs | {base['cpu_us_per_call']:.0f} µs |"
        f" {ours['cpu_us_per_call']:.0f} µs | {ours['cpu_us_per_call'] / base['cpu_us_per_call']:.2f}x |",
        "",
        f"Plane: {ours['episodes_per_s']:.0f} episodes/s, {ours['versions']} versions, {ours['pauses']} abort-mode"
        f" pauses, {ours['aborts']} aborted requests resumed ({ours['resumes']} re-posts), cached tokens"
        f" {ours['cached_tokens']}, {ours['dropped_stale']} groups dropped as stale.",
        f"Governor grants/s: plain core {core:,.0f}; through the runtime (GovernorActor, acquire batches of 64 +"
        f" finish tell) {actor:,.0f}.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        old = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
        start = old.find("## Rollout")
        if start >= 0:
            end = old.find("\n## ", start + 1)
            old = old[:start] + (old[end + 1 :] if end >= 0 else "")
        RESULTS.write_text(old.rstrip("\n") + "\n\n" + text)


if __name__ == "__main__":
    main()
