"""The parts the GSM8K GRPO loop drives: the model checkpoint, the inference servers, the trainer
ranks' and workflows' configs, and the helpers that call the roles (see gsm8k_grpo.py)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import httpx

import rlactors
from recipes.gsm8k_config import ModelConfig, RecipeConfig


def resolve_model(cfg: ModelConfig) -> Path:
    from nodes.inference.models import ensure_smollm2_checkpoint, ensure_tiny_checkpoint

    if cfg.path:
        p = Path(cfg.path).expanduser()
        if not (p / "config.json").exists():
            raise FileNotFoundError(f"model.path={p} is not a Hugging Face model folder (no config.json)")
        return p
    if cfg.tiny:
        return ensure_tiny_checkpoint()
    return ensure_smollm2_checkpoint()


async def start_servers(
    cluster: rlactors.Cluster, cfg: RecipeConfig, model: Path, out: Path
) -> tuple[list[Any], list[str]]:
    """Spawn the inference servers and wait until each is healthy; each writes its log to
    ``<out>/servers/server-<i>.log`` on its host."""
    from nodes.inference.launcher import InferenceServerActor

    s = cfg.servers
    if s.kind == "reference":
        server_cfg = {
            "model_path": str(model),
            "backend": s.backend,
            "max_running_requests": s.max_running_requests,
            "cache_tokens": s.cache_tokens,
            "dtype": s.dtype,
            "device": s.device,
            "extra_args": s.extra_args,
        }
    else:  # real SGLang: on GPUs from this environment, on CPU from its own venv (servers.python)
        server_cfg = {
            "model_path": str(model),
            "python": s.python,
            "device": "cuda" if s.gpus_per_server else "cpu",
            "dtype": s.dtype,
            "extra_args": ["--max-running-requests", str(s.max_running_requests), *s.extra_args],
        }
    env = {"OMP_NUM_THREADS": str(s.threads)} if s.gpus_per_server == 0 else {}
    handles = [
        await cluster.spawn(
            InferenceServerActor,
            kind=s.kind,
            config=server_cfg,
            env=env,  # the worker's environment; the server process inherits it
            startup_timeout_s=s.startup_timeout_s,
            # A restarted server would come back with base weights, outside the weight-update
            # group: let a dead server stay dead; the loop drops it and rollout fails over.
            server_max_restarts=0,
            name=f"server-{i}",
            log_path=str(out / "servers" / f"server-{i}.log"),
            resources={"gpu": s.gpus_per_server},
        )
        for i in range(s.n)
    ]
    urls = list(await asyncio.gather(*(h.url() for h in handles)))
    return handles, urls


def trainer_dict(cfg: RecipeConfig, model: Path, out: Path) -> dict[str, Any]:
    t = cfg.trainer
    push = {"backend": "nccl" if t.device == "cuda" else "gloo", "disk_dir": str(out / "weights"), **t.push}
    return {
        "model_path": str(model),
        "device": t.device,
        "bf16": t.bf16,
        "activation_checkpointing": t.activation_checkpointing,
        "lr": t.lr,
        "weight_decay": t.weight_decay,
        "warmup_steps": t.warmup_steps,
        "lr_schedule": t.lr_schedule,
        "total_steps": max(1, cfg.run.steps * t.n_minibatches),
        "grad_clip": t.grad_clip,
        "max_tokens_per_mb": t.max_tokens_per_mb,
        "n_minibatches": t.n_minibatches,
        "seed": cfg.run.seed,
        "loss": {"temperature": cfg.rollout.temperature, **t.loss},
        "adv": t.adv,
        "push": push,
    }


def workflow_spec(cfg: RecipeConfig, model: Path, *, eval_mode: bool = False) -> dict[str, Any]:
    from nodes.data import PROMPT_SUFFIX

    temperature = cfg.run.eval_temperature if eval_mode else cfg.rollout.temperature
    return {
        "kind": "rlvr" if eval_mode else cfg.rollout.workflow,
        "tokenizer": str(model),
        "reward": cfg.rollout.reward,
        "reward_timeout_s": 10.0,
        "config": {
            "n_samples": 1 if eval_mode else cfg.rollout.n_samples,
            "system_prompt": cfg.data.system_prompt or None,
            "prompt_suffix": PROMPT_SUFFIX,
            "sampling_params": {"max_new_tokens": cfg.rollout.max_new_tokens, "temperature": temperature},
        },
    }


# SGLang 0.5.23's /health runs a one-token generation and gives up itself after 20 s
# (SGLANG_HEALTH_CHECK_TIMEOUT), answering 503; under load it takes 1-20 s. Wait past that.
HEALTH_TIMEOUT_S = 40.0


class Servers:
    """The inference servers' URLs, with health checks and their reported weight versions."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.http = httpx.AsyncClient(timeout=HEALTH_TIMEOUT_S)

    async def healthy(self) -> list[str]:
        """The servers whose ``/health`` (SGLang's recommended probe) answers 200."""

        async def ok(u: str) -> bool:
            try:
                return (await self.http.get(f"{u}/health")).status_code == 200
            except httpx.HTTPError:
                return False

        return [
            u
            for u, good in zip(self.urls, await asyncio.gather(*(ok(u) for u in self.urls)), strict=True)
            if good
        ]

    async def weight_versions(self, urls: list[str]) -> list[int]:
        """Weight versions of the servers that answer (one may die at any moment)."""
        infos = await asyncio.gather(
            *(self.http.get(f"{u}/model_info") for u in urls), return_exceptions=True
        )
        return [int(r.json().get("weight_version") or 0) for r in infos if isinstance(r, httpx.Response)]


async def on_ranks(ranks: list[Any], method: str, *args: Any) -> list[Any]:
    """Call a collective method on every trainer rank. When one rank dies the others fail in their
    collectives with a transport error; the dead rank is the error to report, so after the first
    failure the others get time to finish (a retry must not meet a rank still in the old call)."""
    tasks = [asyncio.ensure_future(getattr(r, method)(*args)) for r in ranks]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        if not all(t.done() for t in tasks):
            await asyncio.wait(tasks, timeout=60)
    finally:  # cancelled, or ranks still stuck after the grace: stop waiting for them
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    errors = [t.exception() for t in tasks if not t.cancelled() and t.exception() is not None]
    if errors:
        died = [e for e in errors if isinstance(e, rlactors.ActorDiedError)]
        raise (died or errors)[0]
    return [t.result() for t in tasks]


async def drop_dead_servers(
    cluster: rlactors.Cluster, servers: Servers, live: list[str], ranks: list[Any], rollouts: list[Any]
) -> list[str]:
    """Re-form the weight-update group without servers that stopped answering; rollout stops using them."""
    healthy = await servers.healthy()
    if healthy == live:
        return live
    gone = sorted(set(live) - set(healthy))
    print(f"servers down: {gone}; re-forming the weight-update group with {len(healthy)}")
    if not healthy:
        raise RuntimeError("every inference server is down")
    for url in gone:
        await asyncio.gather(*(r.retire_server(url) for r in rollouts))
    await connect_servers(cluster, ranks, healthy)
    return healthy


async def connect_servers(cluster: rlactors.Cluster, ranks: list[Any], urls: list[str]) -> None:
    """Form the weight-update group: its store on trainer rank 0's host, at the address that host
    registered with (reachable from servers on other hosts), on a port its agent reserved."""
    where = await cluster.rendezvous(
        f"weights-{uuid.uuid4().hex[:8]}", 1 + len(urls), node_id=await cluster.node_of(ranks[0])
    )
    await on_ranks(ranks, "connect_servers", urls, where["master_address"], where["master_port"])


async def get_batch(buffer: Any, rollouts: list[Any], size: int, version: int, timeout: float) -> Any:
    """The next batch; if none comes in time, say why (a rollout actor's dispatch may have failed)."""
    try:
        return await buffer.get_batch(size, version, timeout)
    except TimeoutError:
        failures = [
            s["failure"] for s in await asyncio.gather(*(r.stats() for r in rollouts)) if s.get("failure")
        ]
        why = f"rollout failed: {failures}" if failures else f"buffer: {await buffer.stats()}"
        raise RuntimeError(
            f"no batch of {size} groups within {timeout:.0f}s at version {version}; {why}"
        ) from None
