"""Asynchronous GRPO on GSM8K: generation and training run at once, staleness bounded.

    python recipes/gsm8k_grpo.py                                # CPU default: SmolLM2-135M, 2 servers, 2 ranks
    python recipes/gsm8k_grpo.py run.steps=20 trainer.lr=1e-5   # overrides: section.key=value
    python recipes/gsm8k_grpo.py --config recipes/configs/gpu.toml --cluster cluster.toml
    python recipes/gsm8k_grpo.py --resume                       # continue from the last checkpoint

The loop (everything else runs concurrently in actors):

    batch <- buffer (oldest admitted first; waits only when the governor's bound says so)
    train  : trainer ranks recompute proximal log-probs, GRPO advantages, decoupled PPO update
    push   : pause rollout dispatch -> servers pause (abort | retract | in_place) -> weights
             over the weight-update group (or from disk) -> continue
    publish: version + 1 to the governor and the rollout actors; log; eval; checkpoint

Synchronous training is ``async.max_staleness=0``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

import rlactors  # noqa: E402
from recipes.gsm8k_config import ConfigError, ModelConfig, RecipeConfig, load_config  # noqa: E402

# --- setup ---------------------------------------------------------------------------------------


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
    cluster: rlactors.Cluster, cfg: RecipeConfig, model: Path
) -> tuple[list[Any], list[str]]:
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
    else:
        server_cfg = {"model_path": str(model), "dtype": s.dtype, "extra_args": s.extra_args}
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
    from nodes.data import PROMPT_SUFFIX, SYSTEM_PROMPT

    temperature = cfg.run.eval_temperature if eval_mode else cfg.rollout.temperature
    return {
        "kind": "rlvr" if eval_mode else cfg.rollout.workflow,
        "tokenizer": str(model),
        "reward": "nodes.rollout.reward:gsm8k_reward",
        "reward_timeout_s": 10.0,
        "config": {
            "n_samples": 1 if eval_mode else cfg.rollout.n_samples,
            "system_prompt": SYSTEM_PROMPT,
            "prompt_suffix": PROMPT_SUFFIX,
            "sampling_params": {"max_new_tokens": cfg.rollout.max_new_tokens, "temperature": temperature},
        },
    }


class Servers:
    """The inference servers' URLs, with health checks and their reported weight versions."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.http = httpx.AsyncClient(timeout=10.0)

    async def healthy(self) -> list[str]:
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
            *(self.http.get(f"{u}/get_model_info") for u in urls), return_exceptions=True
        )
        return [int(r.json().get("weight_version") or 0) for r in infos if isinstance(r, httpx.Response)]


async def on_ranks(ranks: list[Any], method: str, *args: Any) -> list[Any]:
    """Call a collective method on every trainer rank. When one rank dies the others fail in their
    collectives with a transport error; the dead rank is the error to report, so after the first
    failure the others get a moment to report theirs."""
    tasks = [asyncio.ensure_future(getattr(r, method)(*args)) for r in ranks]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    if pending and any(t.exception() is not None for t in done):
        more, _ = await asyncio.wait(pending, timeout=10)
        done |= more
    errors = [t.exception() for t in done if t.exception() is not None]
    if errors:
        for t in tasks:
            if not t.done():
                t.cancel()  # a rank still stuck in a collective: its result is of no use now
        died = [e for e in errors if isinstance(e, rlactors.ActorDiedError)]
        raise (died or errors)[0]
    return [t.result() for t in tasks]


# --- the run -------------------------------------------------------------------------------------


async def evaluate(
    workflow: Any, urls: list[str], items: list[dict[str, Any]], version: int
) -> dict[str, float]:
    """Accuracy of one sample per test prompt at the eval temperature (runs beside training), with
    the policy version it started at (weights may move on while it runs)."""
    from nodes.rollout.client import SGLangClient

    client = SGLangClient(urls, version=version)
    try:
        groups = await asyncio.gather(
            *(workflow.arun_episode(client, it, f"eval/v{version}/{i}") for i, it in enumerate(items))
        )
    except Exception as e:  # evaluation is a side job: it must not stop training
        print(f"eval at version {version} failed: {type(e).__name__}: {e}", file=sys.stderr)
        return {"eval/accuracy": float("nan"), "eval/version": version}
    finally:
        await client.aclose()
    return {
        "eval/accuracy": sum(g.trajectories[0].reward for g in groups) / max(1, len(groups)),
        "eval/version": version,
    }


async def drop_dead_servers(
    servers: Servers, live: list[str], ranks: list[Any], rollouts: list[Any]
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
    await on_ranks(ranks, "connect_servers", healthy)
    return healthy


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


@dataclass
class Prepared:
    """Everything decided before any process starts: paths, model, data, where to resume."""

    out: Path
    model: Path
    train_items: list[dict[str, Any]]
    eval_items: list[dict[str, Any]]
    start_step: int
    cluster: tuple[str, str | None] | None  # (address, secret file) or None for an embedded cluster


def prepare(cfg: RecipeConfig, cluster_target: str | None, resume: bool) -> Prepared:
    from nodes.data import load_gsm8k
    from nodes.trainer.rank import config_from_dict

    out = Path(cfg.run.out_dir).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
    model = resolve_model(cfg.model)
    config_from_dict(trainer_dict(cfg, model, out))  # validate trainer keys before starting anything
    train_items, train_desc = load_gsm8k(
        "train", cfg.data.source, cfg.data.path or None, cfg.data.train_limit or None, cfg.data.seed
    )
    eval_items, _ = load_gsm8k(
        "test", cfg.data.source, cfg.data.path or None, cfg.data.eval_size, cfg.data.seed
    )
    print(f"data: {train_desc}")
    print(f"model: {model}")
    start_step = 0
    latest = out / "checkpoints" / "latest"
    if resume:
        if not latest.exists():
            raise FileNotFoundError(f"--resume: no checkpoint under {latest.parent}")
        start_step = int(latest.read_text().strip())
    target: tuple[str, str | None] | None = None
    if cluster_target and cluster_target.endswith(".toml"):
        from rlactors.config import load_cluster_config

        cc = load_cluster_config(cluster_target)
        target = (cc.address, str(Path(cc.cluster.secret_file).expanduser()))
    elif cluster_target:
        target = (cluster_target, None)
    return Prepared(out, model, train_items, eval_items, start_step, target)


async def run(cfg: RecipeConfig, prep: Prepared, resume: bool) -> None:
    from nodes.buffer import BufferActor
    from nodes.governor import GovernorActor
    from nodes.metrics import MetricsLogger, format_step_line
    from nodes.rollout.actor import RolloutActor
    from nodes.rollout.prompts import trained_position
    from nodes.rollout.workflows import build_workflow
    from nodes.trainer.rank import TrainerRank

    out, model, start_step, version = prep.out, prep.model, prep.start_step, 0
    train_items, eval_items = prep.train_items, prep.eval_items
    ckpt_root = out / "checkpoints"
    latest = ckpt_root / "latest"
    B, eta = cfg.async_.batch_size, cfg.async_.max_staleness
    if prep.cluster is None:
        cluster = await rlactors.init()
    else:
        cluster = await rlactors.connect(prep.cluster[0], secret_file=prep.cluster[1])
    metrics = MetricsLogger(
        out,
        tensorboard=cfg.metrics.tensorboard,
        wandb=cfg.metrics.wandb or None,
        resume_step=start_step if resume else None,
    )
    try:
        t0 = time.monotonic()
        # Trainer ranks: one torch.distributed world (gloo on CPU, nccl on GPU).
        tcfg = trainer_dict(cfg, model, out)
        tenv = {"OMP_NUM_THREADS": str(cfg.trainer.threads)} if cfg.trainer.device == "cpu" else {}
        gpu = 1 if cfg.trainer.device == "cuda" else 0
        ranks = [
            await cluster.spawn(TrainerRank, tcfg, name=f"trainer-{i}", env=tenv, resources={"gpu": gpu})
            for i in range(cfg.trainer.n_ranks)
        ]
        await cluster.collective_group(ranks, backend="nccl" if gpu else "gloo")
        _, urls = await start_servers(cluster, cfg, model)
        await on_ranks(ranks, "setup")
        data = {"done_epochs": 0, "trained": []}  # see nodes/rollout/prompts.py: trained_position
        if resume:
            state = (await on_ranks(ranks, "load", str(ckpt_root / f"step-{start_step}")))[0]
            version = int(state["version"])
            data = (state.get("data_position") or {}).get("data", data)
            print(
                f"resumed from step {start_step} (policy version {version}; data: {data['done_epochs']} epochs "
                f"done, {len(data['trained'])} prompts of the next trained)"
            )
        await on_ranks(ranks, "connect_servers", urls)
        if version:
            await on_ranks(ranks, "push_weights")  # servers start from the base model
        print(
            f"cluster ready in {time.monotonic() - t0:.0f}s: {len(urls)} servers, {len(ranks)} trainer ranks"
        )

        governor = await cluster.spawn(
            GovernorActor, B, eta, cfg.async_.max_concurrent, version, name="governor"
        )
        if resume:
            await governor.recover(version)
        # On resume the buffer refuses prompts trained before the checkpoint; groups admitted but not
        # trained by then are generated again.
        buffer = await cluster.spawn(
            BufferActor, governor, max_staleness=eta, done_ids=data["trained"], name="buffer"
        )
        prompts = {
            "kind": "items",
            "items": train_items,
            "epochs": None,
            "start_epoch": data["done_epochs"],
            "shuffle": True,
            "seed": cfg.data.seed,
            "name": "gsm8k",
        }
        trained = set(data["trained"])
        rollouts = [
            await cluster.spawn(
                RolloutActor,
                urls,
                governor,
                buffer,
                prompts,
                workflow_spec(cfg, model),
                config={"max_inflight": cfg.rollout.max_inflight},
                shard=i,
                num_shards=cfg.rollout.n_actors,
                version=version,
                name=f"rollout-{i}",
            )
            for i in range(cfg.rollout.n_actors)
        ]
        eval_wf = await asyncio.to_thread(build_workflow, workflow_spec(cfg, model, eval_mode=True))
        servers = Servers(urls)
        eval_task = asyncio.create_task(evaluate(eval_wf, urls, eval_items, version))
        live = list(urls)

        for step in range(start_step, cfg.run.steps):
            t_wait = time.monotonic()
            batch = await get_batch(buffer, rollouts, B, version, cfg.run.batch_timeout_s)
            t_train = time.monotonic()
            stats = (await on_ranks(ranks, "train_step", batch))[0]
            trained.update(g.group_id for g in batch.groups)
            t_push = time.monotonic()
            live = await drop_dead_servers(servers, live, ranks, rollouts)
            await asyncio.gather(*(r.pause() for r in rollouts))
            try:
                try:
                    push = (await on_ranks(ranks, "push_weights"))[0]
                except Exception as e:  # a server died during the push: drop it and push again, once
                    if (healthy := await drop_dead_servers(servers, live, ranks, rollouts)) == live:
                        raise
                    print(f"weight push failed ({type(e).__name__}); retrying without the dead server")
                    live = healthy
                    push = (await on_ranks(ranks, "push_weights"))[0]
                version += 1
                await governor.set_version(version)
                await asyncio.gather(*(r.set_version(version) for r in rollouts))
            finally:
                await asyncio.gather(*(r.resume() for r in rollouts))
            t_end = time.monotonic()

            trajs = batch.trajectories
            roll = await asyncio.gather(*(r.stats() for r in rollouts))
            m: dict[str, float] = {
                "version": version,
                "reward/mean": sum(t.reward for t in trajs) / len(trajs),
                "staleness/max": batch.max_staleness,
                "staleness/mean": stats.get("staleness_mean", 0.0),
                "staleness/bound": eta,
                "servers/min_weight_version": min(await servers.weight_versions(live), default=-1),
                "throughput/samples_per_s": len(trajs) / (t_end - t_wait),
                "throughput/tokens_per_s": sum(r["tokens_per_s"] for r in roll),
                "time/wait_s": t_train - t_wait,
                "time/train_s": t_push - t_train,
                "time/push_s": t_end - t_push,
                "rollout/aborts": sum(r.get("client_aborts", 0) for r in roll),
                "rollout/cached_tokens": sum(r.get("client_cached_tokens", 0) for r in roll),
                **{f"train/{k}": float(v) for k, v in stats.items() if isinstance(v, (int, float))},
                **{f"push/{k}": float(v) for k, v in push.items() if isinstance(v, (int, float))},
                "data/groups": ",".join(g.group_id for g in batch.groups),
            }
            last = step + 1 == cfg.run.steps
            if eval_task is not None and eval_task.done():
                m.update(eval_task.result())
                eval_task = None
            if eval_task is None and (last or (cfg.run.eval_every and (step + 1) % cfg.run.eval_every == 0)):
                eval_task = asyncio.create_task(evaluate(eval_wf, live, eval_items, version))
            if last and eval_task is not None:
                m.update(await eval_task)
                eval_task = None
            metrics.log(step + 1, m)
            print(format_step_line(step + 1, cfg.run.steps, m), flush=True)
            if last or (cfg.run.checkpoint_every and (step + 1) % cfg.run.checkpoint_every == 0):
                path = ckpt_root / f"step-{step + 1}"
                data = trained_position(trained, len(train_items), data["done_epochs"])
                trained = set(data["trained"])  # whole epochs are a number from now on
                position = {"step": step + 1, "version": version, "data": data}
                await on_ranks(ranks, "save", str(path), position)
                latest.write_text(str(step + 1))
        if eval_task is not None:
            eval_task.cancel()
        await asyncio.gather(*(r.stop() for r in rollouts), return_exceptions=True)
        await servers.http.aclose()
    finally:
        metrics.close()
        await cluster.close()


def report(out: Path) -> None:
    """The plot, and where everything is."""
    from nodes.metrics import plot_run

    png = plot_run(out / "metrics.jsonl", out / "run.png")
    latest = out / "checkpoints" / "latest"
    ckpt = out / "checkpoints" / f"step-{latest.read_text().strip()}" if latest.exists() else "-"
    print(f"done: metrics {out / 'metrics.jsonl'} | plot {png} | checkpoint {ckpt}")
    print(f"      tensorboard --logdir {out / 'tensorboard'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="TOML config (default: recipes/configs/cpu.toml's values, built in)")
    ap.add_argument(
        "--cluster", help="cluster.toml started with `rlactors up`, or a head address (default: local)"
    )
    ap.add_argument("--resume", action="store_true", help="continue from the last checkpoint in run.out_dir")
    ap.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        prep = prepare(cfg, args.cluster, args.resume)
        asyncio.run(run(cfg, prep, args.resume))
        report(prep.out)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except rlactors.ActorDiedError as e:  # e.g. a trainer rank was killed: the run cannot go on
        print(
            f"error: {e}; the run stopped. Continue from the last checkpoint with --resume", file=sys.stderr
        )
        return 1
    except rlactors.ClusterError as e:  # e.g. no cluster at the given address
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # the run cannot continue (no data coming, every server down, ...)
        print(
            f"error: {e}; the run stopped. Continue from the last checkpoint with --resume", file=sys.stderr
        )
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    # Actors inherit this environment: keep their output to warnings (the step line is what matters).
    os.environ.setdefault("RLACTORS_LOG_LEVEL", "WARNING")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' weight-loading bars
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
