"""End to end: the GSM8K GRPO recipe, asynchronous (eta = 2) against synchronous (eta = 0).

The same workload runs twice per setting, once with ``async.max_staleness=0`` (generation of
batch v+1 cannot start before the weights of version v+1 are pushed: generate, then train)
and once with ``async.max_staleness=2`` (generation runs on while the trainer trains). Each run
is the real recipe (recipes/gsm8k_grpo.py) as a subprocess with a fresh embedded cluster: the
servers, rollout actor, governor, buffer and FSDP trainer ranks are all real processes.

Settings:
  sim  -- ``sim`` reference servers (latency model, no model compute) with per-request length
          spread (EOS with a fixed chance per token, so a few requests straggle to the cap),
          a tiny trainer model; the rollout plane's time is of the same order as training.
  hf   -- ``hf`` reference servers running the same tiny model (real forward passes on the CPU,
          sharing the 2 cores with the trainer ranks).

Time per step comes from the ``time`` stamps in the run's metrics.jsonl (wall clock when a
step's metrics were logged), skipping the first ``--warmup`` steps and the last step (it also
awaits the final evaluation); samples/s = trajectories trained in the measured steps / their
wall time. The time/wait_s, time/train_s and time/push_s columns say where a step's time goes.

    python bench/e2e.py                    # both settings, ~10 minutes on 2 cores
    python bench/e2e.py --only sim --steps 6
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "gsm8k_grpo.py"

COMMON = [
    "model.tiny=true",
    "data.source=offline",
    "data.train_limit=4096",
    "data.eval_size=1",
    "run.checkpoint_every=0",
    "metrics.tensorboard=false",
    "trainer.max_tokens_per_mb=2048",
]

# sim: 4 servers; 64-token cap, EOS chance 3% per token (mean ~ 28 tokens, ~14% hit the cap);
# 0.25 s per decode step + 2 ms per running sequence, so a capped request takes ~16 s.
SIM = [
    "servers.reference.backend=sim",
    "servers.n=4",
    "servers.reference.max_running_requests=256",
    'servers.reference.extra_args=["--sim-decode-s-base", "0.25", "--sim-decode-s-per-seq", "0.002", '
    '"--sim-prefill-s-per-token", "0.0002", "--sim-eos-prob", "0.03"]',
    "async.batch_size=16",
    "async.max_concurrent=256",
    "rollout.max_inflight=256",
    "rollout.workflow_args.n_samples=2",
    "rollout.workflow_args.max_new_tokens=64",
]

# hf: the tiny model served for real by 2 one-thread servers (EOS arrives when the model samples it).
HF = [
    "servers.reference.backend=hf",
    "servers.n=2",
    "servers.reference.max_running_requests=32",
    "async.batch_size=4",
    "async.max_concurrent=64",
    "rollout.workflow_args.n_samples=2",
    "rollout.workflow_args.max_new_tokens=48",
]

SETTINGS = {"sim": SIM, "hf": HF}


@dataclass
class RunResult:
    """The measured part of one recipe run."""

    setting: str
    eta: int
    steps: int = 0
    s_per_step: float = float("nan")
    samples_per_s: float = float("nan")
    wait_s: float = float("nan")
    train_s: float = float("nan")
    push_s: float = float("nan")
    staleness_mean: float = float("nan")
    staleness_max: int = 0
    wall_s: float = 0.0
    load: tuple[float, float] = (0.0, 0.0)  # 1-min load average at start and end
    error: str = ""
    rows: list[dict] = field(default_factory=list)


def measure(rows: list[dict], warmup: int) -> dict[str, float]:
    """Per-step wall time and samples/s over steps after ``warmup``, without the evaluating last step."""
    if rows and "eval/accuracy" in rows[-1] and len(rows) > warmup + 2:
        rows = rows[:-1]
    if len(rows) < warmup + 2:
        raise ValueError(f"need at least {warmup + 2} logged steps, got {len(rows)}")
    measured = rows[warmup + 1 :]  # intervals: stamp[i] - stamp[i-1]
    span = rows[-1]["time"] - rows[warmup]["time"]
    mean = statistics.fmean
    return {
        "steps": len(measured),
        "s_per_step": span / len(measured),
        "samples_per_s": sum(r["train/n_seqs"] for r in measured) / span,
        "wait_s": mean(r["time/wait_s"] for r in measured),
        "train_s": mean(r["time/train_s"] for r in measured),
        "push_s": mean(r["time/push_s"] for r in measured),
        "staleness_mean": mean(r["staleness/mean"] for r in measured),
        "staleness_max": max(int(r["staleness/max"]) for r in measured),
    }


def run_recipe(setting: str, eta: int, steps: int, warmup: int, out_root: Path, timeout: float) -> RunResult:
    """One recipe run as a subprocess; its metrics.jsonl measured."""
    out = out_root / f"{setting}-eta{eta}"
    args = [
        *COMMON,
        *SETTINGS[setting],
        f"async.max_staleness={eta}",
        f"run.steps={steps}",
        f"run.out_dir={out}",
    ]
    res = RunResult(setting, eta)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "RLACTORS_LOG_LEVEL": "WARNING",
        "TRANSFORMERS_VERBOSITY": "error",
        "TOKENIZERS_PARALLELISM": "false",
    }
    load0 = os.getloadavg()[0]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, str(RECIPE), *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        res.error = f"timed out after {timeout:.0f} s"
        return res
    res.wall_s = time.monotonic() - t0
    res.load = (load0, os.getloadavg()[0])
    for line in proc.stdout.splitlines():
        if line.startswith("step "):
            print(f"  [{setting} eta={eta}] {line}", flush=True)
    if proc.returncode != 0:
        res.error = f"exit {proc.returncode}: {proc.stderr.strip()[-2000:]}"
        return res
    res.rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    try:
        for k, v in measure(res.rows, warmup).items():
            setattr(res, k, v)
    except ValueError as e:
        res.error = str(e)
    return res


def table(results: list[RunResult]) -> str:
    """A markdown table: one row per run, the async/sync ratio on each async row."""
    head = (
        "| setting | mode | steps | samples/s | s/step | wait s | train s | push s | staleness mean/max "
        "| async/sync samples/s | load 1-min start/end |\n| --- | --- | --- | --- | --- | --- | --- | --- "
        "| --- | --- | --- |\n"
    )
    sync = {r.setting: r for r in results if r.eta == 0}
    lines = []
    for r in results:
        mode = "sync (eta=0)" if r.eta == 0 else f"async (eta={r.eta})"
        if r.error:
            lines.append(
                f"| {r.setting} | {mode} | failed: {r.error.splitlines()[-1][:120]} | | | | | | | | |"
            )
            continue
        base = sync.get(r.setting)
        ratio = (
            f"**{r.samples_per_s / base.samples_per_s:.2f}x**" if r.eta and base and not base.error else "1"
        )
        lines.append(
            f"| {r.setting} | {mode} | {r.steps} | {r.samples_per_s:.2f} | {r.s_per_step:.1f} | {r.wait_s:.1f} "
            f"| {r.train_s:.1f} | {r.push_s:.2f} | {r.staleness_mean:.2f}/{r.staleness_max} | {ratio} "
            f"| {r.load[0]:.1f}/{r.load[1]:.1f} |"
        )
    return head + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--only", choices=sorted(SETTINGS), action="append", help="setting(s) to run (default: all)"
    )
    ap.add_argument("--steps", type=int, default=6, help="training steps per run (default 6)")
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out of the measurement")
    ap.add_argument("--eta", type=int, default=2, help="max staleness of the asynchronous run")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per recipe run")
    ap.add_argument("--out", help="where the runs write (default: a temporary folder)")
    args = ap.parse_args(argv)
    settings = args.only or list(SETTINGS)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        flush=True,
    )
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp:
        out_root = Path(args.out) if args.out else Path(tmp)
        for setting in settings:
            for eta in (0, args.eta):
                print(f"{setting}, max_staleness={eta}: {args.steps} steps ...", flush=True)
                r = run_recipe(setting, eta, args.steps, args.warmup, out_root, args.timeout)
                print(f"  done in {r.wall_s:.0f} s{' -- ' + r.error if r.error else ''}", flush=True)
                results.append(r)
    print()
    print(table(results))
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
