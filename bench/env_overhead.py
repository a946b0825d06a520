"""CPU per episode of the environment workflows (nodes/rollout/environments) against a bare
``AgentWorkflow`` agent making the same chat calls, with a generator that answers at once (no model:
what is measured is the workflow, the endpoint and the environment's own code).

- ``agent-1``: an agent that makes one chat call and returns a reward (the baseline of ``verifiers``),
  run on the actor's loop (``agent_runner = "loop"``, where the environments run too); ``(thread)``:
  the same with AgentWorkflow's default runner, a thread per run;
- ``verifiers``: a verifiers ``SingleTurnEnv`` (one call, scored by a 2-function rubric);
- ``agent-2``: an agent that makes two chat calls, the second continuing the first (``openenv``'s);
- ``openenv``: an OpenEnv episode against a real ``openenv-core`` server process: reset, two model
  turns and two steps over its WebSocket session. Its server's CPU (psutil) is reported apart.
- ``verifiers-v1``: a verifiers v1 episode (tests/envs/v1_sums, the ``null`` harness: one chat call)
  through verifiers' env server and the bridge, real processes in the taskset's own Python
  environment (made first, or found made). Their CPU, the harness program each episode starts
  included (reaped children), is reported apart.

CPU is this process's (user + system, all threads) over ``--groups`` groups of ``--samples``
episodes, ``--concurrency`` groups at a time, after a warm-up; each variant ``--repeats`` times,
interleaved; the median is reported, per episode.

    python bench/env_overhead.py --groups 64 --samples 4 --concurrency 8 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import psutil

from nodes.inference.models import ensure_tiny_checkpoint
from nodes.rollout.agents import AgentConfig, AgentWorkflow
from nodes.rollout.client import GenRequest, GenResult
from nodes.rollout.environments import (
    OpenEnvConfig,
    OpenEnvWorkflow,
    VerifiersConfig,
    VerifiersV1Config,
    VerifiersV1Workflow,
    VerifiersWorkflow,
)
from nodes.rollout.environments.verifiers_v1 import BRIDGE, process_env
from nodes.rollout.reward import RewardRunner


class Instant:
    """Stands in for SGLangClient: answers every request at once with the same short text."""

    def __init__(self, tokenizer: Any) -> None:
        self.ids = [*tokenizer.encode("apple pie", add_special_tokens=False), tokenizer.eos_token_id]

    async def agenerate(self, request: GenRequest) -> GenResult:
        n = len(self.ids)
        return GenResult(
            request.rid or "",
            list(self.ids),
            [-0.5] * n,
            [0] * n,
            "stop",
            "apple pie",
            len(request.input_ids),
            [0],
            "instant",
        )


async def one_call(client: Any, item: dict[str, Any]) -> float:
    """The baseline agent: one chat call, as a SingleTurnEnv's rollout makes."""
    r = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": item["question"]}]
    )
    return float(len(r.choices[0].message.content or "") > 0)


async def two_calls(client: Any, item: dict[str, Any]) -> float:
    """The baseline agent: two chat calls, the second continuing the first, as an OpenEnv episode's."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Say a word (seed None)."}]
    for _ in range(2):
        r = await client.chat.completions.create(model="policy", messages=messages)
        messages += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": "Another word."},
        ]
    return 1.0


def start_server(app: str) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", app, "--port", str(port), "--log-level", "warning"],
        stderr=subprocess.DEVNULL,
    )
    import httpx

    url = f"http://127.0.0.1:{port}"
    while True:
        assert proc.poll() is None, "the OpenEnv server did not start"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)


def start_v1(
    n: int, tok: Any, reward: RewardRunner
) -> tuple[list[subprocess.Popen[bytes]], VerifiersV1Workflow]:
    """verifiers' env server and the bridge for tests/envs/v1_sums, and a workflow on them."""
    import json

    import httpx

    cfg = VerifiersV1Config(taskset="rlactors-v1-sums", packages=["tests/envs/v1_sums"], n_samples=n)
    python, ports = str(cfg.python()), []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    address, env = f"tcp://127.0.0.1:{ports[0]}", process_env(cfg.python())
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for cmd in (
            [python, BRIDGE, "server", "--config", json.dumps(cfg.full_env_config()), "--address", address],
            [python, BRIDGE, "bridge", "--address", address, "--host", "127.0.0.1", "--port", str(ports[1])],
        )
    ]
    url = f"http://127.0.0.1:{ports[1]}"
    while True:
        assert all(p.poll() is None for p in procs), "the v1 env server or bridge did not start"
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    wf = VerifiersV1Workflow(tok, reward, cfg)

    async def pick() -> str:
        return url

    wf.servers.pick = pick  # type: ignore[method-assign]
    return procs, wf


async def measure(
    wf: Any, gen: Instant, item: dict[str, Any], groups: int, concurrency: int, servers: list[psutil.Process]
) -> tuple[float, float]:
    """(this process's CPU seconds, the servers') over ``groups`` groups, ``concurrency`` at a time."""
    me = psutil.Process()
    sem = asyncio.Semaphore(concurrency)

    async def group(i: int) -> None:
        async with sem:
            await wf.arun_episode(gen, item, f"g{i}")

    def cpu(ps: list[psutil.Process]) -> float:  # their reaped children's too (a harness's program)
        return sum(sum(p.cpu_times()[:4]) for p in ps)

    t0, s0 = cpu([me]), cpu(servers)
    await asyncio.gather(*(group(i) for i in range(groups)))
    return cpu([me]) - t0, cpu(servers) - s0


async def main(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ensure_tiny_checkpoint()), local_files_only=True)
    gen = Instant(tok)
    reward = RewardRunner(lambda c, i: 0.0)
    n = args.samples
    proc, url = start_server("tests.envs.openenv_app:app")
    server = psutil.Process(proc.pid)
    v1_procs, v1_wf = start_v1(n, tok, reward)
    try:
        vf_wf = VerifiersWorkflow(tok, reward, VerifiersConfig(env="tests.envs.sample_env", n_samples=n))

        def agent(fn: str, runner: str) -> AgentWorkflow:
            return AgentWorkflow(
                tok, reward, AgentConfig(agent=f"bench.env_overhead:{fn}", n_samples=n, agent_runner=runner)
            )

        item = {**dict(vf_wf.env.get_dataset()[0]), "id": "x"}
        v1_item = {"id": "x", "task": v1_wf.config.described()["tasks"][0]}
        v1_servers = [psutil.Process(p.pid) for p in v1_procs]
        variants = {
            "agent-1": (agent("one_call", "loop"), [], item),
            "agent-1 (thread)": (agent("one_call", "thread"), [], item),
            "verifiers": (vf_wf, [], item),
            "verifiers-v1": (v1_wf, v1_servers, v1_item),
            "agent-2": (agent("two_calls", "loop"), [], item),
            "agent-2 (thread)": (agent("two_calls", "thread"), [], item),
            "openenv": (
                OpenEnvWorkflow(tok, reward, OpenEnvConfig(env_urls=[url], n_samples=n)),
                [server],
                item,
            ),
        }
        results: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
        for wf, srv, it in variants.values():  # warm-up: endpoints started, imports done, caches filled
            await measure(wf, gen, it, max(2, args.groups // 8), args.concurrency, srv)
        for _ in range(args.repeats):
            for name, (wf, srv, it) in variants.items():
                results[name].append(await measure(wf, gen, it, args.groups, args.concurrency, srv))
    finally:
        for p in [proc, *v1_procs]:
            p.kill()
            p.wait()
    episodes = args.groups * n
    print(
        f"# {platform.node()} ({os.cpu_count()} cores), python {platform.python_version()}; "
        f"{args.groups} groups x {n} episodes, {args.concurrency} groups at a time, median of {args.repeats}"
    )
    per = {k: statistics.median(c for c, _ in v) / episodes * 1e3 for k, v in results.items()}
    srv_per = {
        k: statistics.median(s for _, s in results[k]) / episodes * 1e3 for k in ("openenv", "verifiers-v1")
    }
    print(
        "| variant | CPU per episode, this process (ms) | over its agent baseline (ms) | server CPU per episode (ms) |"
    )
    print("| --- | --- | --- | --- |")
    rows = [
        ("agent-1", None),
        ("agent-1 (thread)", "agent-1"),
        ("verifiers", "agent-1"),
        ("verifiers-v1", "agent-1"),
        ("agent-2", None),
        ("agent-2 (thread)", "agent-2"),
        ("openenv", "agent-2"),
    ]
    for name, base in rows:
        over = f"{per[name] - per[base]:+.2f}" if base else "-"
        print(f"| {name} | {per[name]:.2f} | {over} | {f'{srv_per[name]:.2f}' if name in srv_per else '-'} |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    asyncio.run(main(ap.parse_args()))
