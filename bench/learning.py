"""Does the CPU default learn? The default run against two controls, on the same seeds, in one go.

    default  -- ``python recipes/gsm8k_grpo.py`` as shipped (asynchronous, max staleness 2)
    frozen   -- the same with ``trainer.lr=0``: the whole pipeline runs, the weights never move,
                so its eval accuracy must stay where it started (the control for "it learned")
    sync     -- the same with ``async.max_staleness=0``: generate, then train (the control for
                "asynchrony costs no accuracy and saves wall time")

Each run is the real recipe as a subprocess (fresh embedded cluster, same data and seeds), one
after another (they would share the two cores otherwise). Held-out accuracy is evaluated greedily
(or at the config's ``run.eval_temperature``) on the same ``data.eval_size`` problems every
``--eval-every`` steps, with 95% Wilson intervals. It prints start and end accuracy and wall time per run and writes one PNG: eval accuracy against
wall-clock minutes (and train reward against step) for the three runs.

    python bench/learning.py                     # ~30 minutes on 2 cores: 3 runs of the default
    python bench/learning.py --steps 10 --only default,frozen
    python bench/learning.py --only default,frozen,dynamic,tis,gspo,lora --png bench/learning_variants.png

With ``--config`` every run uses that config instead of the CPU default, e.g. the agent with a
Python tool against its frozen control; for an agent's config the eval's tool-call rate (the share
of held-out episodes that call a tool, with its interval) is reported and plotted beside accuracy:

    python bench/learning.py --config recipes/configs/agent_cpu.toml --only default,frozen \
        --png bench/agent_learning.png
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from nodes.driver.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "gsm8k_grpo.py"

RUNS = {
    "default": [],
    "frozen": ["trainer.lr=0"],
    "sync": ["async.max_staleness=0"],
    # the algorithm variants (issue 26), each one change to the default
    "dynamic": ["buffer.drop_no_signal=true"],  # DAPO's dynamic sampling
    "tis": ["trainer.loss.fn_args.tis_cap=2.0"],  # token TIS on the behaviour weight
    "gspo": ["trainer.loss.fn_args.seq_ratio=true"],  # GSPO's sequence ratio, its paper's clip
    "lora": ["trainer.lora.enabled=true", "trainer.lr=2e-4"],  # LoRA r16, at 10x the lr
}
COLOURS = {
    "default": "tab:blue",
    "frozen": "tab:gray",
    "sync": "tab:orange",
    "dynamic": "tab:green",
    "tis": "tab:red",
    "gspo": "tab:purple",
    "lora": "tab:brown",
}


def run_one(name: str, out: Path, steps: int, eval_every: int, extra: list[str], config: str | None) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    args = [
        *(["--config", config] if config else []),
        f"run.out_dir={out}",
        f"run.steps={steps}",
        f"run.eval_every={eval_every}",
        "run.checkpoint_every=0",
        "metrics.tensorboard=false",
        *RUNS[name],
        *extra,
    ]
    print(f"[{name}] python recipes/gsm8k_grpo.py {' '.join(args)}", flush=True)
    t0 = time.time()
    with (out / "recipe.log").open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(RECIPE), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
        )
        assert proc.stdout is not None
        for line in proc.stdout:  # progress: the recipe's step lines, as they come
            log.write(line)
            log.flush()
            if line.startswith(("step ", "eval accuracy", "error")):
                print(f"[{name}] {line.rstrip()}", flush=True)
        rc = proc.wait()
    wall = time.time() - t0
    if rc != 0:
        raise SystemExit(f"[{name}] the recipe failed (exit {rc}); see {out / 'recipe.log'}")
    return summarize(name, out, wall)


def summarize(name: str, out: Path, wall: float | None = None) -> dict:
    """A run's evals, rewards and episode numbers from its ``metrics.jsonl``; ``wall``: its wall
    time (None: from its first step's start to its last step's end, as the metrics record them)."""
    rows = read_metrics(out / "metrics.jsonl")
    start = rows[0]["time"] - rows[0].get("time/wait_s", 0) - rows[0].get("time/train_s", 0)
    if wall is None:
        wall = rows[-1]["time"] - start
    evals = [
        {
            "step": r["step"],
            "minutes": (r["time"] - start) / 60,
            "version": r["eval/version"],
            "acc": r["eval/accuracy"],
            "low": r["eval/ci_low"],
            "high": r["eval/ci_high"],
            # an agent's: the share of held-out episodes that call a tool, with its interval
            "tools": r.get("eval/tool_call_rate"),
            "tools_low": r.get("eval/tool_call_ci_low"),
            "tools_high": r.get("eval/tool_call_ci_high"),
        }
        for r in rows
        if r.get("eval/accuracy") is not None
    ]
    episode = sorted({k for r in rows for k in r if k.startswith("episode/")})
    config = json.loads((out / "config.json").read_text()) if (out / "config.json").exists() else {}
    return {
        "name": name,
        "wall_s": wall,
        "eval_temperature": (config.get("run") or {}).get("eval_temperature", 0.0),
        "evals": evals,
        "reward": [(r["step"], r["reward/mean"]) for r in rows if r.get("reward/mean") is not None],
        # an agent's own numbers per training episode (tool calls, turns, ...), mean per step
        "episode": {k: [(r["step"], r[k]) for r in rows if k in r] for k in episode},
        "agent_errors": max((r.get("rollout/agent_errors", 0) for r in rows), default=0),
    }


def plot(results: list[dict], png: Path) -> None:
    from matplotlib.figure import Figure

    agent = any(e["tools"] is not None for r in results for e in r["evals"])
    fig = Figure(figsize=(18 if agent else 12, 4.8), dpi=110, layout="constrained")
    acc_ax, rew_ax, *tool_ax = fig.subplots(1, 3 if agent else 2)
    for r in results:
        c = COLOURS.get(r["name"])
        xs = [e["minutes"] for e in r["evals"]]
        acc_ax.plot(xs, [e["acc"] for e in r["evals"]], "o-", color=c, label=r["name"])
        acc_ax.fill_between(
            xs, [e["low"] for e in r["evals"]], [e["high"] for e in r["evals"]], color=c, alpha=0.15
        )
        steps, rewards = zip(*r["reward"], strict=True) if r["reward"] else ((), ())
        rew_ax.plot(steps, rewards, "-", color=c, label=r["name"], alpha=0.8)
        if agent:
            ev = [e for e in r["evals"] if e["tools"] is not None]
            xs = [e["minutes"] for e in ev]
            tool_ax[0].plot(xs, [e["tools"] for e in ev], "s--", color=c, label=f"{r['name']} (eval)")
            tool_ax[0].fill_between(
                xs, [e["tools_low"] for e in ev], [e["tools_high"] for e in ev], color=c, alpha=0.15
            )
    temps = {r.get("eval_temperature", 0.0) for r in results}
    how = "greedy" if temps == {0.0} else "sampled at T=" + "/".join(f"{t:g}" for t in sorted(temps))
    acc_ax.set(title=f"held-out accuracy ({how}, 95% intervals)", xlabel="wall-clock minutes", ylim=(0, 1))
    rew_ax.set(title="train reward (mean per step)", xlabel="step", ylim=(0, 1))
    if agent:
        tool_ax[0].set(
            title="held-out episodes calling a tool (95% intervals)", xlabel="wall-clock minutes", ylim=(0, 1)
        )
    for ax in (acc_ax, rew_ax, *tool_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10, help="training steps per run (the default run's)")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--only", default="default,frozen,sync", help="comma-separated: " + ", ".join(RUNS))
    ap.add_argument("--out", default="runs/bench_learning")
    ap.add_argument("--config", help="a recipe config for every run (default: the CPU default)")
    ap.add_argument("--png", help="where the plot goes (default: OUT/learning.png)")
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: the table and plot of the runs already in --out",
    )
    ap.add_argument("overrides", nargs="*", metavar="section.key=value", help="passed to every run")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n]
    if unknown := [n for n in names if n not in RUNS]:
        ap.error(f"unknown runs {unknown}; choose from {list(RUNS)}")
    out = Path(args.out).resolve()
    print(f"machine: {platform.platform()}, {os.cpu_count()} cores, python {platform.python_version()}")
    if args.report_only:  # the runs of an earlier invocation (one stopped part-way included)
        results = [summarize(n, out / n) for n in names]
    else:
        results = [
            run_one(n, out / n, args.steps, args.eval_every, args.overrides, args.config) for n in names
        ]

    if args.config:
        print(f"config: {args.config}")
    print(f"\n{'run':8} {'eval start':>18} {'eval end':>18} {'end - frozen end':>17} {'wall':>8}")
    frozen = next((r for r in results if r["name"] == "frozen"), None)
    for r in results:
        a, b = r["evals"][0], r["evals"][-1]
        diff = f"{b['acc'] - frozen['evals'][-1]['acc']:+.2f}" if frozen and r is not frozen else "-"
        print(
            f"{r['name']:8} {a['acc']:.2f} [{a['low']:.2f}, {a['high']:.2f}] "
            f"{b['acc']:.2f} [{b['low']:.2f}, {b['high']:.2f}] {diff:>17} {r['wall_s'] / 60:7.1f}m"
        )
    if frozen:
        fb = frozen["evals"][-1]
        for r in results:
            if r is not frozen:
                b = r["evals"][-1]
                apart = b["low"] > fb["high"]
                print(
                    f"{r['name']}: trained - frozen = {b['acc'] - fb['acc']:+.2f}, "
                    f"{'outside' if apart else 'NOT outside'} both intervals"
                )
    for r in results:
        ev = [e for e in r["evals"] if e["tools"] is not None]
        if ev:
            a, b = ev[0], ev[-1]
            print(
                f"{r['name']}: tool-call rate {a['tools']:.2f} [{a['tools_low']:.2f}, {a['tools_high']:.2f}] "
                f"at version {a['version']} -> {b['tools']:.2f} [{b['tools_low']:.2f}, {b['tools_high']:.2f}] "
                f"at version {b['version']}; agent errors {r['agent_errors']:.0f}"
            )
        for k, xs in r["episode"].items():
            if xs:
                vals = [v for _, v in xs]
                head, tail = vals[: max(1, len(vals) // 4)], vals[-max(1, len(vals) // 4) :]
                print(
                    f"{r['name']}: train {k} mean {sum(head) / len(head):.2f} in the first quarter of "
                    f"steps -> {sum(tail) / len(tail):.2f} in the last"
                )
    png = Path(args.png).resolve() if args.png else out / "learning.png"
    plot(results, png)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"plot {png} | data {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
