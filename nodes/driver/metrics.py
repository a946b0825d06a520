"""What a training run shows and writes: a progress line per step, metrics files, a final plot.

:class:`MetricsLogger` appends one JSON object per step to ``<out_dir>/metrics.jsonl``
(flushed line by line, so a crash loses nothing already logged), mirrors the numbers to
TensorBoard (``<out_dir>/tensorboard``) and, when configured, to Weights & Biases.
:func:`plot_run` draws reward, eval accuracy, staleness and throughput over steps into a
PNG; :func:`format_step_line` is the one-line summary printed per step.

Keys the recipe produces: ``reward/mean``, ``eval/accuracy``, ``staleness/mean``,
``staleness/max``, ``throughput/samples_per_s``, ``throughput/tokens_per_s``,
``time/wait_s``, ``time/train_s``, ``time/push_s`` (``time/eval_s`` where the first evaluation held
the first push); any other numeric key (trainer stats)
is written through unchanged.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog

from nodes.common.disk import DiskFullError, append_whole, full_line, is_disk_full

__all__ = [
    "MetricsLogger",
    "accuracy_interval",
    "format_step_line",
    "interval_text",
    "plot_run",
    "read_metrics",
]

log = structlog.get_logger(__name__)


def _scalar(value: Any) -> float | int | None:
    """A finite number from ints, floats, numpy/torch scalars; None for anything else."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _jsonable(value: Any) -> Any:
    """``value`` as strict JSON: numbers as numbers (NaN/inf become null), str/None kept, the rest as str."""
    if value is None or isinstance(value, str):
        return value
    try:
        float(value)
    except (TypeError, ValueError):
        return str(value)
    return _scalar(value)


class MetricsLogger:
    """Writes each step's metrics to JSONL, TensorBoard, and W&B when configured.

    ``resume_step``: on ``--resume`` from a checkpoint at that step, records after it (logged
    by the interrupted run after its last checkpoint) are dropped from the JSONL and purged
    from TensorBoard, so the resumed run's steps replace them. Without it the JSONL starts
    empty: a new run in the same folder replaces the old one's metrics.
    ``wandb``: keyword arguments for ``wandb.init`` (project, name, ...); ``None`` disables it.
    """

    def __init__(
        self,
        out_dir: Path,
        tensorboard: bool = True,
        wandb: dict[str, Any] | None = None,
        resume_step: int | None = None,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "metrics.jsonl"
        self._wandb = self._init_wandb(wandb) if wandb is not None else None  # fail before touching files
        kept = (
            [r for r in read_metrics(self.path) if r["step"] <= resume_step]
            if resume_step is not None
            else []
        )
        _replace(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self._file = self.path.open("ab", buffering=0)  # a line goes out whole or not at all
        self._tb: Any = None
        self.tensorboard_dir: Path | None = None
        if tensorboard:
            self._tb = self._init_tensorboard(None if resume_step is None else resume_step + 1)

    def _init_tensorboard(self, purge_step: int | None) -> Any:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch or tensorboard missing: JSONL still has everything
            log.warning("tensorboard_unavailable", reason=str(e), hint="pip install tensorboard")
            return None
        self.tensorboard_dir = self.out_dir / "tensorboard"
        return SummaryWriter(log_dir=str(self.tensorboard_dir), purge_step=purge_step, flush_secs=30)

    def _init_wandb(self, config: dict[str, Any]) -> Any:
        try:
            import wandb
        except ImportError as e:
            raise ImportError(
                "W&B logging is configured (metrics.wandb) but the 'wandb' package is not installed: "
                "pip install wandb, or remove the wandb settings from the config"
            ) from e
        return wandb.init(**{"dir": str(self.out_dir), **config})

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record ``metrics`` for ``step``: one JSONL line (written whole or, on a full disk, not at
        all: :class:`~nodes.common.disk.DiskFullError`), TensorBoard scalars, W&B."""
        record = {"step": int(step), "time": round(time.time(), 3)}
        record.update({str(k): _jsonable(v) for k, v in metrics.items()})
        append_whole(self._file, json.dumps(record) + "\n", f"metrics of step {step}")
        scalars = {k: v for k, v in ((str(k), _scalar(v)) for k, v in metrics.items()) if v is not None}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, global_step=int(step))
        if self._wandb is not None:
            self._wandb.log(scalars, step=int(step))

    def close(self) -> None:
        """Flush and close every sink; safe to call twice."""
        if not self._file.closed:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _replace(path: Path, text: str) -> None:
    """``path``'s content replaced by ``text`` through a temporary file: a full disk leaves it as it was."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if is_disk_full(e):
            raise DiskFullError(
                full_line(f"rewriting {path}", path.parent, len(text.encode())) + "; it is as it was"
            ) from e
        raise
    os.replace(tmp, path)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl, in file order; a torn or non-record line (a crash mid-write) is skipped."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            out.append(rec)
    return out


def _by_step(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One merged record per step (train and eval metrics may be logged separately), steps ascending."""
    merged: dict[int, dict[str, Any]] = {}
    for rec in records:
        merged.setdefault(rec["step"], {}).update(rec)
    return [merged[s] for s in sorted(merged)]


def accuracy_interval(correct: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of an accuracy of ``correct`` out of ``n`` (95% for z = 1.96):
    unlike p +- z*sqrt(p(1-p)/n) it stays inside [0, 1] and is not zero-wide at 0 or 1."""
    if n <= 0:
        return 0.0, 1.0
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def interval_text(metrics: Mapping[str, Any]) -> str:
    """``"±0.09"``: half the width of the eval's interval in ``metrics``; ``""`` without one."""
    lo, hi = _num(metrics, "eval/ci_low"), _num(metrics, "eval/ci_high")
    return f"±{(hi - lo) / 2:.2f}" if lo is not None and hi is not None else ""


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], v) for r in rows if (v := _scalar(r.get(key))) is not None]
    return [p[0] for p in pts], [float(p[1]) for p in pts]


def plot_run(metrics_jsonl: Path, out_png: Path) -> Path:
    """A 2x2 PNG over steps: train reward, eval accuracy, staleness (mean/max), throughput.

    Panels whose metrics are missing say so instead of failing; returns ``out_png``.
    """
    from matplotlib.figure import Figure  # no pyplot: no global state, Agg canvas, no display needed
    from matplotlib.ticker import MaxNLocator

    rows = _by_step(read_metrics(Path(metrics_jsonl)))
    fig = Figure(figsize=(11, 7.5), dpi=110, layout="constrained")
    axes = fig.subplots(2, 2, sharex=True)
    panels = [
        (axes[0, 0], "reward (train)", [("reward/mean", "mean reward", "-")]),
        (axes[0, 1], "eval accuracy", [("eval/accuracy", "accuracy", "o-")]),
        (axes[1, 0], "staleness (policy versions)", [("staleness/mean", "mean", "-"), ("staleness/max", "max", "--")]),
        (axes[1, 1], "throughput", [("throughput/tokens_per_s", "tokens/s", "-")]),
    ]  # fmt: skip
    for ax, title, lines in panels:
        ax.set_title(title)
        ax.grid(alpha=0.3)
        drawn = 0
        for key, label, style in lines:
            xs, ys = _series(rows, key)
            if xs:
                ax.plot(xs, ys, style, label=label, markersize=4)
                drawn += 1
        if ax is axes[0, 1]:  # the eval's 95% intervals
            pts = [
                (r["step"], lo, hi)
                for r in rows
                if (lo := _scalar(r.get("eval/ci_low"))) is not None
                and (hi := _scalar(r.get("eval/ci_high"))) is not None
            ]
            if pts:
                ax.vlines(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    [p[2] for p in pts],
                    color="tab:blue",
                    alpha=0.5,
                    linewidth=6,
                    label="95% interval",
                )
        if ax is axes[1, 1]:
            xs, ys = _series(rows, "throughput/samples_per_s")
            if xs:
                twin = ax.twinx() if drawn else ax
                twin.plot(xs, ys, ":", color="tab:orange", label="samples/s")
                twin.set_ylabel("samples/s")
                if twin is not ax:
                    twin.legend(loc="lower right", fontsize=8)
                drawn += 1
            if drawn:
                ax.set_ylabel("tokens/s")
        if drawn:
            ax.legend(loc="best", fontsize=8)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
    axes[0, 1].set_ylim(-0.02, 1.02)  # accuracy is a fraction: show it on its whole range
    for ax in axes[1]:
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(f"{Path(metrics_jsonl).parent.name}: {len(rows)} steps")
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png)
    return out_png


def _num(metrics: Mapping[str, Any], key: str) -> float | None:
    v = _scalar(metrics.get(key))
    return None if v is None else float(v)


def format_step_line(step: int, total: int | None, metrics: Mapping[str, Any]) -> str:
    """One compact progress line, e.g.
    ``step 3/10 | reward 0.41 | acc 0.38 | stale 0.7/2 | 212 tok/s | wait 1.2s train 8.3s push 0.9s``.
    Missing metrics are left out.
    """
    parts = [f"step {step}/{total}" if total else f"step {step}"]
    if (r := _num(metrics, "reward/mean")) is not None:
        parts.append(f"reward {r:.2f}")
    if (a := _num(metrics, "eval/accuracy")) is not None:
        parts.append(f"acc {a:.2f}{interval_text(metrics)}")
    if (t := _num(metrics, "eval/tool_call_rate")) is not None:  # an agent's held-out episodes
        half = (
            (_num(metrics, "eval/tool_call_ci_high") or t) - (_num(metrics, "eval/tool_call_ci_low") or t)
        ) / 2
        parts.append(f"tools {t:.2f}±{half:.2f}")
    joined, left = _num(metrics, "servers/joined") or 0, _num(metrics, "servers/left") or 0
    if joined or left:  # only when the live set changed
        change = " ".join(f"{sign}{n:.0f}" for sign, n in (("+", joined), ("-", left)) if n)
        parts.append(f"servers {_num(metrics, 'servers/live') or 0:.0f} ({change})")
    mean, mx = _num(metrics, "staleness/mean"), _num(metrics, "staleness/max")
    if mean is not None or mx is not None:
        parts.append("stale " + "/".join(f"{v:.{n}f}" for v, n in ((mean, 1), (mx, 0)) if v is not None))
    rates = []
    if (t := _num(metrics, "throughput/tokens_per_s")) is not None:
        rates.append(f"{t:.0f} tok/s")
    if (s := _num(metrics, "throughput/samples_per_s")) is not None:
        rates.append(f"{s:.2f} samples/s")
    if rates:
        parts.append(" ".join(rates))
    times = [
        f"{name} {v:.1f}s"
        for name in ("wait", "train", "eval", "push")
        if (v := _num(metrics, f"time/{name}_s")) is not None
    ]
    if times:
        parts.append(" ".join(times))
    return " | ".join(parts)
