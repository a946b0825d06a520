"""Asynchronous GRPO on GSM8K: generation and training run at once, staleness bounded.

    python recipes/gsm8k_grpo.py                                # CPU default: SmolLM2-135M, 2 servers, 2 ranks
    python recipes/gsm8k_grpo.py run.steps=20 trainer.lr=1e-5   # overrides: section.key=value
    python recipes/gsm8k_grpo.py --config recipes/configs/gpu.toml --cluster cluster.toml
    python recipes/gsm8k_grpo.py --resume                       # continue from the last checkpoint

The loop (:func:`loop`; everything else runs concurrently in actors):

    batch      <- buffer (oldest admitted first; waits only when the governor's bound says so)
    rewards    <- each group's rewards, shaped by [advantage.shaping]
    advantages <- [advantage] fn over each group's shaped rewards (GRPO by default), on the batch
    train      : every trainer rank: proximal log-probs, then [trainer.loss] fn (decoupled PPO)
    publish    : pause rollout dispatch -> servers pause -> weights over the weight-update group
                 (or from disk) -> the trainer's new version to the governor and rollout actors -> continue
    then log, evaluate, checkpoint

Reward, advantage estimator, loss and workflow are import paths in the config: change one there,
or change the loop here. recipes/gsm8k_plane.py builds what the loop drives; nodes/driver/policy_sync.py
publishes a version, nodes/driver/evaluator.py evaluates, nodes/driver/run_state.py keeps the step, the version
and the data position and writes checkpoints.

Synchronous training is ``async.max_staleness=0``. A rollout actor that dies is restarted while
training goes on (its episodes are re-queued, none lost or trained twice); a dead trainer rank,
governor or buffer stops the run, to be continued with ``--resume``. SIGTERM (a scheduler stopping
the job) lets a step that is training finish, checkpoints the last completed step if it is not on
disk, and exits 143 naming the checkpoint ``--resume`` will use (within ``run.term_grace_s``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import rlactors
from nodes.common.disk import DiskFullError
from nodes.driver.advantage import batch_advantages, shape_rewards
from nodes.driver.data import DataError, load_data
from nodes.driver.evaluator import Evaluator
from nodes.driver.metrics import MetricsLogger, format_step_line
from nodes.driver.run_state import RunLockedError, RunState, Terminated, Termination
from nodes.driver.watchdog import StallWatchdog
from nodes.plane.buffer import RepeatedFailureError
from nodes.trainer.manifest import CheckpointError
from recipes.gsm8k_config import ConfigError, RecipeConfig, describe_run, load_config, render_config
from recipes.gsm8k_plane import (
    Plane,
    check_teacher_tokenizer,
    eval_spec,
    resolve_model,
    start_plane,
    with_lora,
)


def prepare(cfg: RecipeConfig, out: Path, resume: bool) -> tuple[RunState, Path, list[Any], list[Any]]:
    """What is decided before any process starts: where the run resumes (a missing or corrupt
    checkpoint is an error now), the output folder, the model, the training and held-out data.
    Bad data (:class:`~nodes.driver.data.DataError`) is found first, before anything is written."""
    data = load_data(cfg.data, cfg.rollout.workflow_args)  # source = "env": the environment's datasets
    model = resolve_model(cfg.model)
    unchecked = check_teacher_tokenizer(cfg, model)  # distillation compares token ids: one tokenizer for both
    state = RunState(out, resume)  # the folder is this run's alone from here (out/.lock)
    (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2, default=str))
    (out / "config.toml").write_text(render_config(cfg))  # the same, readable: every key with its meaning
    state.n_items = len(data.train)
    print(
        f"data: {data.train_about} (data.source = {cfg.data.source!r})\neval: {data.eval_about}\nmodel: {model}"
    )
    print("\n".join([*describe_run(cfg), *([unchecked] if unchecked else [])]), flush=True)
    return state, model, data.train, data.eval


async def train(cfg: RecipeConfig, out: Path, cluster: tuple[str, str | None] | None, resume: bool) -> None:
    """The run: bring the plane up, then step until ``run.steps`` (0: until stopped)."""
    state, model, train_items, eval_items = await asyncio.to_thread(prepare, cfg, out, resume)
    # before the cluster: TensorBoard's import and wandb.init hold this loop for seconds, which an
    # embedded head on it would take for a stall of its own
    metrics = MetricsLogger(
        out,
        tensorboard=cfg.metrics.tensorboard,
        wandb=cfg.metrics.wandb or None,
        resume_step=state.resume_from,
    )
    term = Termination(cfg.run.term_grace_s)
    c: rlactors.Cluster | None = None
    try:
        c = await (
            rlactors.init() if cluster is None else rlactors.connect(cluster[0], secret_file=cluster[1])
        )
        reach = c.record_run(out)  # `rlactors status|stack|pool` reach this run while it runs
        plane = await term.wait(start_plane(c, cfg, model, state, train_items))
        if cfg.data.source == "online":  # episodes come from the session API's clients
            await term.wait(announce_sessions(c, cfg, plane, out))
        lora = with_lora(cfg).rollout.client.lora  # the adapter's name under adapter pushes
        evaluator = Evaluator(eval_spec(cfg, model), eval_items, plane.sync.keys, lora)
        await evaluator.start(plane.sync.live, state.version)
        stall = StallWatchdog(plane, out, cfg.run.stall_after_s, command=f"rlactors stack {reach}".strip())
        try:
            await loop(cfg, plane, state, evaluator, metrics, term, stall)
        except Terminated:  # SIGTERM: the step in progress finished (or never started training)
            if state.step and state.saved_step != state.step:
                await state.save(plane.ranks)
            raise
        finally:
            stall.close()
            evaluator.cancel()
            await plane.stop()
    finally:
        term.close()
        metrics.close()
        if c is not None:
            await c.close()


async def loop(
    cfg: RecipeConfig,
    plane: Plane,
    state: RunState,
    evaluator: Evaluator,
    metrics: MetricsLogger,
    term: Termination,
    stall: StallWatchdog,
) -> None:
    """Asynchronous GRPO: batch -> rewards -> advantages -> train -> publish -> log (eval, checkpoint)."""
    B, steps = cfg.async_.batch_size, cfg.run.steps  # steps 0: until SIGTERM or Ctrl-C
    online = cfg.data.source == "online"  # a service: a quiet period without sessions is a wait, not a stall
    while not steps or state.step < steps:
        started, t_wait = time.time(), time.monotonic()
        if not online:  # a step past run.stall_after_s leaves a report naming what it waits on
            stall.begin(state.step + 1)
        batch = await term.wait(plane.get_batch(B, state.version, cfg.run.batch_timeout_s, idle=online))
        if online:
            stall.begin(state.step + 1)
        t_train = time.monotonic()
        rewards = shape_rewards(batch, cfg.advantage.shaping)  # [advantage.shaping] bias, scale, clip
        batch.advantages = batch_advantages(batch, rewards, cfg.advantage)  # [advantage] fn (GRPO)
        stats = (await plane.ranks.train_step(batch))[0]  # [trainer.loss] fn on every rank
        # the new policy version is the trainer's; prompts dropped for no signal count as seen
        state.record(batch, stats, seen=await plane.buffer.take_dropped())
        t_trained = time.monotonic()
        times = {"wait": t_train - t_wait, "train": t_trained - t_train}
        if held := await evaluator.baseline():  # the start's accuracy is measured on the start's weights
            times["eval"] = held
        t_push = time.monotonic()
        push = await plane.sync.publish(state.version)  # pause -> push weights -> new version -> continue
        times["push"] = time.monotonic() - t_push
        stall.end()

        m = await plane.step_metrics(batch, stats, push, times, cfg.async_.max_staleness)
        if state.step == steps:  # the final policy's accuracy, after any evaluation still running
            m.update(await evaluator.finish(plane.sync.live, state.version))
        else:
            m.update(evaluator.poll() or {})
            if cfg.run.eval_every and state.step % cfg.run.eval_every == 0:
                await evaluator.start(plane.sync.live, state.version)
        metrics.log(state.step, m)
        print(format_step_line(state.step, steps or None, m), flush=True)
        await plane.record_step(state.step, started, times)  # the run's timeline (run.trace)
        if state.checkpoint_due(cfg.run.checkpoint_every, steps):
            await state.save(plane.ranks)
        term.check()
    if line := evaluator.summary():
        print(line, flush=True)


async def announce_sessions(c: rlactors.Cluster, cfg: RecipeConfig, plane: Plane, out: Path) -> None:
    """Online mode: where the session APIs listen and their key, in ``<out>/sessions.json`` (mode 600)."""
    from nodes.rollout.sessions import session_urls

    # the APIs start with the rollout actors' first episodes; a short run.batch_timeout_s (in online
    # mode how often an idle run says it waits) must not cut that short
    urls = await session_urls(
        c, [f"rollout-{i}" for i in range(cfg.rollout.n_actors)], max(cfg.run.batch_timeout_s, 120.0)
    )
    path = out / "sessions.json"
    fd = os.open(
        path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600
    )  # the key: readable by the run's user only
    with os.fdopen(fd, "w") as f:
        json.dump({"urls": urls, "api_key": plane.sync.keys.api_key}, f)
    print(f"online: sessions at {' '.join(urls)} (the key: {path})", flush=True)


def cluster_address(target: str | None) -> tuple[str, str | None] | None:
    """``(head address, secret file)`` of ``--cluster`` (a cluster.toml or an address); None: local."""
    if target is None or not target.endswith(".toml"):
        return None if target is None else (target, None)
    from rlactors.launch.config import load_cluster_config

    cc = load_cluster_config(target)
    return cc.address, str(Path(cc.cluster.secret_file).expanduser())


def last_checkpoint(out: Path) -> Path | None:
    """The checkpoint ``--resume`` continues from, if any."""
    latest = out / "checkpoints" / "latest"
    return out / "checkpoints" / f"step-{latest.read_text().strip()}" if latest.exists() else None


def report(out: Path, plots: bool = True) -> None:
    """The plots (``[metrics] plots``), and where everything is."""
    why = "metrics.plots = false"
    if plots:
        try:  # matplotlib is optional: a bare install (the GPU check's wheelhouse) goes without plots
            import matplotlib  # noqa: F401
        except ImportError:
            plots, why = False, "no matplotlib"
    if not plots:
        print(
            f"done: metrics {out / 'metrics.jsonl'} | plot - ({why}) | checkpoint {last_checkpoint(out) or '-'}"
        )
        return
    from nodes.common.trace import plot_timeline
    from nodes.driver.metrics import plot_run

    png = plot_run(out / "metrics.jsonl", out / "run.png")
    print(f"done: metrics {out / 'metrics.jsonl'} | plot {png} | checkpoint {last_checkpoint(out) or '-'}")
    if (trace := out / "trace.json").exists():
        try:
            timeline = plot_timeline(trace, out / "timeline.png")
        except ValueError as e:  # an unreadable trace must not turn a finished run into a failed one
            print(f"      timeline {trace}: could not draw it ({e})")
        else:
            print(f"      timeline {trace} (Perfetto, chrome://tracing) | {timeline or '-'}")
    if (out / "tensorboard").is_dir():  # [metrics] tensorboard = false writes none
        print(f"      tensorboard --logdir {out / 'tensorboard'}")


def resume_hint(out: Path) -> str:
    """What ``--resume`` will do, for a message about a run that stopped."""
    if (ckpt := last_checkpoint(out)) is None:
        return "no checkpoint was saved, so --resume has nothing to continue from"
    return f"continue from {ckpt} with --resume"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--config",
        help="TOML config (default: recipes/configs/cpu.toml's values, built in, without its shaping)",
    )
    ap.add_argument(
        "--cluster", help="cluster.toml started with `rlactors up`, or a head address (default: local)"
    )
    ap.add_argument("--resume", action="store_true", help="continue from the last checkpoint in run.out_dir")
    ap.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config as TOML (every key, its meaning and allowed values) and exit",
    )
    ap.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="config overrides, e.g. run.steps=20 trainer.lr=1e-5",
    )
    args = ap.parse_intermixed_args(argv)  # overrides before and after flags, as `--resume run.steps=9`
    out = Path()
    try:
        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            print(render_config(cfg), end="")
            return 0
        out = Path(cfg.run.out_dir).expanduser().resolve()
        asyncio.run(train(cfg, out, cluster_address(args.cluster), args.resume))
        report(out, cfg.metrics.plots)
    except (ConfigError, DataError, FileNotFoundError, CheckpointError, RunLockedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RepeatedFailureError as e:  # a reward, environment or agent that fails again and again
        print(f"error: {e}", file=sys.stderr)
        return 2
    except DiskFullError as e:  # a checkpoint, metrics or the trace did not fit; nothing earlier harmed
        print(f"error: {e}; the run stopped; {resume_hint(out)} once there is room", file=sys.stderr)
        return 2
    except rlactors.ClusterError as e:  # e.g. no cluster at the given address
        if not isinstance(e, rlactors.ActorDiedError):
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"error: {e}; the run stopped; {resume_hint(out)}", file=sys.stderr)  # e.g. a rank was killed
        return 1
    except RuntimeError as e:  # the run cannot continue (no data coming, every server down, ...)
        print(f"error: {e}; the run stopped; {resume_hint(out)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Terminated:  # SIGTERM: the last completed step is on disk
        print(f"terminated: shut down cleanly; {resume_hint(out)}", file=sys.stderr)
        return 143
    except asyncio.CancelledError:  # SIGTERM, and the step in progress outlasted run.term_grace_s
        print(f"terminated: shut down cleanly (past run.term_grace_s); {resume_hint(out)}", file=sys.stderr)
        return 143
    return 0


if __name__ == "__main__":
    # Actors inherit this environment: keep their output to warnings (the step line is what matters).
    os.environ.setdefault("RLACTORS_LOG_LEVEL", "WARNING")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' weight-loading bars
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
