"""Asynchronous GRPO on GSM8K: generation and training run at once, staleness bounded.

    python recipes/gsm8k_grpo.py                                # CPU default: SmolLM2-135M, 2 servers, 2 ranks
    python recipes/gsm8k_grpo.py run.steps=20 trainer.lr=1e-5   # overrides: section.key=value
    python recipes/gsm8k_grpo.py --config recipes/configs/gpu.toml --cluster cluster.toml
    python recipes/gsm8k_grpo.py --resume                       # continue from the last checkpoint

The loop (everything else runs concurrently in actors):

    batch      <- buffer (oldest admitted first; waits only when the governor's bound says so)
    advantages <- [advantage] fn over the [reward]-shaped rewards of each group (GRPO by default)
    train      : every trainer rank: proximal log-probs, then [trainer.loss] fn (decoupled PPO)
    publish    : pause rollout dispatch -> servers pause -> weights over the weight-update group
                 (or from disk) -> version + 1 to the governor and rollout actors -> continue
    then log, evaluate, checkpoint

Reward, advantage estimator, loss and workflow are import paths in the config: change one there,
or change the loop here. nodes/policy_sync.py does the publishing.

Synchronous training is ``async.max_staleness=0``. A rollout actor that dies is restarted while
training goes on (its episodes are re-queued, none lost or trained twice); a dead trainer rank,
governor or buffer stops the run, to be continued with ``--resume``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

import rlactors  # noqa: E402
from nodes.trainer.manifest import CheckpointError, resume_point, write_latest  # noqa: E402
from recipes.gsm8k_config import ConfigError, RecipeConfig, load_config  # noqa: E402
from recipes.gsm8k_parts import (  # noqa: E402
    get_batch,
    resolve_model,
    start_servers,
    train_config,
    workflow_spec,
)

# --- the run -------------------------------------------------------------------------------------

# A rollout actor holds nothing that cannot be re-created: when it dies the runtime restarts it and the
# buffer re-queues its episodes. Past this many deaths the run stops (ActorDiedError).
ROLLOUT_MAX_RESTARTS = 3


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
    from nodes.metrics import accuracy_interval

    correct = sum(g.trajectories[0].reward for g in groups)
    low, high = accuracy_interval(correct, len(groups))
    return {
        "eval/accuracy": correct / max(1, len(groups)),
        "eval/ci_low": low,
        "eval/ci_high": high,
        "eval/n": len(groups),
        "eval/version": version,
    }


def eval_summary(first: dict[str, float], last: dict[str, float]) -> str:
    """``eval accuracy 0.23 (±0.07) → 0.45 (±0.09) ...``: the run's result in one line."""
    from nodes.metrics import interval_text

    a, b = first["eval/accuracy"], last["eval/accuracy"]

    if b > first["eval/ci_high"] and a < last["eval/ci_low"]:
        verdict = "higher, outside both intervals"
    elif b < first["eval/ci_low"] and a > last["eval/ci_high"]:
        verdict = "LOWER, outside both intervals"
    else:
        verdict = "no clear change: the intervals overlap"
    return (
        f"eval accuracy {a:.2f} ({interval_text(first)}) at version {first['eval/version']:.0f} → {b:.2f} ({interval_text(last)}) "
        f"at version {last['eval/version']:.0f}: {verdict} "
        f"({last['eval/n']:.0f} held-out problems, 95% intervals)"
    )


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

    out = Path(cfg.run.out_dir).expanduser().resolve()
    # the resume point first: a missing or corrupt checkpoint is an error before anything starts
    start_step = resume_point(out / "checkpoints")[0] if resume else 0
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
    model = resolve_model(cfg.model)
    train_items, train_desc = load_gsm8k(
        "train", cfg.data.source, cfg.data.path or None, cfg.data.train_limit or None, cfg.data.seed
    )
    eval_items, _ = load_gsm8k(
        "test", cfg.data.source, cfg.data.path or None, cfg.data.eval_size, cfg.data.seed
    )
    print(f"data: {train_desc}")
    print(f"model: {model}")
    target: tuple[str, str | None] | None = None
    if cluster_target and cluster_target.endswith(".toml"):
        from rlactors.config import load_cluster_config

        cc = load_cluster_config(cluster_target)
        target = (cc.address, str(Path(cc.cluster.secret_file).expanduser()))
    elif cluster_target:
        target = (cluster_target, None)
    return Prepared(out, model, train_items, eval_items, start_step, target)


async def run(cfg: RecipeConfig, prep: Prepared, resume: bool) -> None:
    from nodes.advantage import batch_advantages
    from nodes.buffer import BufferActor
    from nodes.governor import GovernorActor
    from nodes.metrics import MetricsLogger, format_step_line
    from nodes.policy_sync import PolicySync
    from nodes.rollout.actor import RolloutActor, RolloutHandle
    from nodes.rollout.prompts import trained_position
    from nodes.rollout.reward import shape_rewards
    from nodes.rollout.workflows import build_workflow
    from nodes.trainer.rank import TrainerRank

    # SIGTERM (a scheduler stopping the job, `kill`) shuts down like Ctrl-C: cancelling this task
    # unwinds every `finally` below, so actors, servers and the local cluster are stopped
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    out, model, start_step, version = prep.out, prep.model, prep.start_step, 0
    train_items, eval_items = prep.train_items, prep.eval_items
    ckpt_root = out / "checkpoints"
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
        tcfg = train_config(cfg, model, out)
        tenv = {"OMP_NUM_THREADS": str(tcfg.threads)} if tcfg.device == "cpu" else {}
        gpu = 1 if tcfg.device == "cuda" else 0
        ranks = rlactors.ActorGroup(
            [
                await cluster.spawn(TrainerRank, tcfg, name=f"trainer-{i}", env=tenv, resources={"gpu": gpu})
                for i in range(tcfg.n_ranks)
            ]
        )
        await cluster.collective_group(list(ranks), backend="nccl" if gpu else "gloo")
        _, urls = await start_servers(cluster, cfg, model, out)
        await ranks.setup()
        data = {"done_epochs": 0, "trained": []}  # see nodes/rollout/prompts.py: trained_position
        if resume:
            state = (await ranks.load(str(ckpt_root / f"step-{start_step}")))[0]
            version = int(state["version"])
            data = (state.get("data_position") or {}).get("data", data)
            print(
                f"resumed from step {start_step} (policy version {version}; data: {data['done_epochs']} epochs "
                f"done, {len(data['trained'])} prompts of the next trained)"
            )
        sync = PolicySync(cluster, ranks, urls, report=print)
        await sync.connect()
        if version:
            await ranks.push_weights()  # servers start from the base model
        print(
            f"cluster ready in {time.monotonic() - t0:.0f}s: {len(urls)} servers, {len(ranks)} trainer ranks"
        )

        governor = await cluster.spawn(GovernorActor, cfg.async_, version, name="governor")
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
            RolloutHandle(  # its calls survive a restart: they wait for the new incarnation
                await cluster.spawn(
                    RolloutActor,
                    urls,
                    governor,
                    buffer,
                    prompts,
                    workflow_spec(cfg, model),
                    config=cfg.rollout,
                    shard=i,
                    num_shards=cfg.rollout.n_actors,
                    version=version,
                    name=f"rollout-{i}",
                    max_restarts=ROLLOUT_MAX_RESTARTS,
                ),
                ROLLOUT_MAX_RESTARTS,
            )
            for i in range(cfg.rollout.n_actors)
        ]
        sync.attach(governor, rollouts)
        restarts = 0
        eval_wf = await asyncio.to_thread(build_workflow, workflow_spec(cfg, model, eval_mode=True))
        eval_task = asyncio.create_task(evaluate(eval_wf, urls, eval_items, version))
        evals: list[dict[str, float]] = []

        for step in range(start_step, cfg.run.steps):
            t_wait = time.monotonic()
            batch = await get_batch(buffer, rollouts, B, version, cfg.run.batch_timeout_s)
            t_train = time.monotonic()
            rewards = shape_rewards([g.rewards for g in batch.groups], cfg.reward)
            advantages = batch_advantages(batch, rewards, cfg.advantage)
            stats = (await ranks.train_step(batch, advantages))[0]
            trained.update(g.group_id for g in batch.groups)
            t_push = time.monotonic()
            version += 1
            push = await sync.publish(version)
            t_end = time.monotonic()

            trajs = batch.trajectories
            roll = await asyncio.gather(*(r.stats() for r in rollouts))
            if (n := sum(r["restarts"] for r in roll)) > restarts:
                print(f"rollout actors restarted after dying: {n} so far (their episodes re-queued)")
                restarts = n
            m: dict[str, float] = {
                "version": version,
                "reward/mean": sum(t.reward for t in trajs) / len(trajs),
                "staleness/max": batch.max_staleness,
                "staleness/mean": stats.get("staleness_mean", 0.0),
                "staleness/bound": eta,
                "servers/min_weight_version": min(await sync.weight_versions(), default=-1),
                "throughput/samples_per_s": len(trajs) / (t_end - t_wait),
                "throughput/tokens_per_s": sum(r["tokens_per_s"] for r in roll),
                "time/wait_s": t_train - t_wait,
                "time/train_s": t_push - t_train,
                "time/push_s": t_end - t_push,
                "rollout/aborts": sum(r.get("client_aborts", 0) for r in roll),
                "rollout/cached_tokens": sum(r.get("client_cached_tokens", 0) for r in roll),
                "rollout/restarts": restarts,
                **{f"train/{k}": float(v) for k, v in stats.items() if isinstance(v, (int, float))},
                **{f"push/{k}": float(v) for k, v in push.items() if isinstance(v, (int, float))},
                "data/groups": ",".join(g.group_id for g in batch.groups),
            }
            last = step + 1 == cfg.run.steps
            if eval_task is not None and eval_task.done():
                evals.append(eval_task.result())
                m.update(evals[-1])
                eval_task = None
            if last:  # finish an earlier eval still running, then evaluate the final policy
                if eval_task is not None:
                    evals.append(await eval_task)
                eval_task = None
                evals.append(await evaluate(eval_wf, sync.live, eval_items, version))
                m.update(evals[-1])
            elif eval_task is None and cfg.run.eval_every and (step + 1) % cfg.run.eval_every == 0:
                eval_task = asyncio.create_task(evaluate(eval_wf, sync.live, eval_items, version))
            metrics.log(step + 1, m)
            print(format_step_line(step + 1, cfg.run.steps, m), flush=True)
            if last or (cfg.run.checkpoint_every and (step + 1) % cfg.run.checkpoint_every == 0):
                path = ckpt_root / f"step-{step + 1}"
                data = trained_position(trained, len(train_items), data["done_epochs"])
                trained = set(data["trained"])  # whole epochs are a number from now on
                position = {"step": step + 1, "version": version, "data": data}
                await ranks.save(str(path), position)
                write_latest(ckpt_root, step + 1)
        if eval_task is not None:
            eval_task.cancel()
        done = [e for e in evals if e["eval/accuracy"] == e["eval/accuracy"]]  # not NaN (failed)
        if len(done) >= 2:
            print(eval_summary(done[0], done[-1]), flush=True)
        await asyncio.gather(*(r.stop() for r in rollouts), return_exceptions=True)
        await sync.aclose()
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
    except (ConfigError, FileNotFoundError, CheckpointError) as e:
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
    except asyncio.CancelledError:  # SIGTERM (see run)
        print(
            "terminated: shut down cleanly; continue from the last checkpoint with --resume", file=sys.stderr
        )
        return 143
    return 0


if __name__ == "__main__":
    # Actors inherit this environment: keep their output to warnings (the step line is what matters).
    os.environ.setdefault("RLACTORS_LOG_LEVEL", "WARNING")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' weight-loading bars
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
