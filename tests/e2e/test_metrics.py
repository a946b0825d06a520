"""Metrics: JSONL + TensorBoard + (fake) W&B sinks, resume truncation, the run plot, the progress line."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from nodes.driver.metrics import MetricsLogger, format_step_line, plot_run, read_metrics


def _step_metrics(step: int) -> dict[str, Any]:
    return {
        "reward/mean": 0.1 * step,
        "staleness/mean": 0.5 + 0.1 * step,
        "staleness/max": 2,
        "throughput/samples_per_s": 3.0 + step,
        "throughput/tokens_per_s": 200.0 + 10 * step,
        "time/wait_s": 1.2,
        "time/train_s": 8.3,
        "time/push_s": 0.9,
        "trainer/grad_norm": 0.75,
    }


def _write_run(out: Path, steps: int = 6, **kw: Any) -> MetricsLogger:
    logger = MetricsLogger(out, **kw)
    for step in range(1, steps + 1):
        logger.log(step, _step_metrics(step))
        if step % 2 == 0:
            acc = 0.05 * step  # eval logged on its own line, with its interval
            logger.log(step, {"eval/accuracy": acc, "eval/ci_low": acc - 0.04, "eval/ci_high": acc + 0.05})
    return logger


def test_jsonl_lines_are_written_and_flushed_per_log(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log(1, {"reward/mean": 0.25, "bad": float("nan"), "note": "warmup", "flag": True})
    # readable before close: each line is flushed
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1
    rec = json.loads(lines[0])
    assert rec["step"] == 1 and rec["reward/mean"] == 0.25 and isinstance(rec["time"], float)
    assert rec["bad"] is None and rec["note"] == "warmup" and rec["flag"] == 1  # strict JSON: no NaN
    logger.log(2, _step_metrics(2))
    logger.close()
    logger.close()
    recs = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2]
    assert recs[1]["trainer/grad_norm"] == 0.75  # pass-through keys kept


def test_resume_drops_steps_after_the_checkpoint(tmp_path: Path) -> None:
    _write_run(tmp_path, steps=5, tensorboard=False).close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "reward/me')  # torn line from a crash mid-write
    with MetricsLogger(tmp_path, tensorboard=False, resume_step=3) as logger:
        assert sorted({r["step"] for r in read_metrics(logger.path)}) == [1, 2, 3]
        logger.log(4, {"reward/mean": 9.0})
    recs = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs][-1] == 4 and recs[-1]["reward/mean"] == 9.0
    assert sum(r["step"] == 4 for r in recs) == 1
    MetricsLogger(tmp_path, tensorboard=False).close()  # a fresh run in the same folder starts empty
    assert read_metrics(tmp_path / "metrics.jsonl") == []


def test_tensorboard_event_file_has_the_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    pytest.importorskip("torch")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = _write_run(tmp_path, steps=3)
    logger.close()
    assert logger.tensorboard_dir is not None
    events = list(logger.tensorboard_dir.glob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(logger.tensorboard_dir))
    acc.Reload()
    assert {"reward/mean", "eval/accuracy", "trainer/grad_norm"} <= set(acc.Tags()["scalars"])
    assert [(e.step, round(e.value, 3)) for e in acc.Scalars("reward/mean")] == [(1, 0.1), (2, 0.2), (3, 0.3)]


def test_missing_tensorboard_warns_and_continues(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import raises ImportError
    with MetricsLogger(tmp_path) as logger:
        assert logger.tensorboard_dir is None
        logger.log(1, {"reward/mean": 1.0})
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["reward/mean"] == 1.0


def test_wandb_missing_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match="pip install wandb"):
        MetricsLogger(tmp_path, tensorboard=False, wandb={"project": "p"})


def test_wandb_receives_scalars_when_configured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, Any]] = []

    class Run:
        def log(self, data: dict, step: int) -> None:
            calls.append(("log", (step, data)))

        def finish(self) -> None:
            calls.append(("finish", None))

    def init(**kw: Any) -> Run:
        calls.append(("init", kw))
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    with MetricsLogger(tmp_path, tensorboard=False, wandb={"project": "gsm8k"}) as logger:
        logger.log(7, {"reward/mean": 0.5, "note": "x"})
    assert calls[0] == ("init", {"dir": str(tmp_path), "project": "gsm8k"})
    assert calls[1] == ("log", (7, {"reward/mean": 0.5}))
    assert calls[2] == ("finish", None)


def test_plot_run_draws_a_real_png(tmp_path: Path) -> None:
    import matplotlib.image

    _write_run(tmp_path, steps=8, tensorboard=False).close()
    png = plot_run(tmp_path / "metrics.jsonl", tmp_path / "plots" / "run.png")
    assert png.exists() and png.stat().st_size > 10_000
    img = matplotlib.image.imread(png)
    assert img.shape[0] > 500 and img.shape[1] > 800
    assert img[..., :3].std() > 0.05  # not a blank canvas


def test_plot_run_tolerates_missing_keys_and_empty_files(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(1, {"reward/mean": 0.1})
        logger.log(2, {"throughput/samples_per_s": 2.0})
    assert plot_run(tmp_path / "metrics.jsonl", tmp_path / "sparse.png").stat().st_size > 10_000
    assert plot_run(tmp_path / "absent.jsonl", tmp_path / "empty.png").exists()


def test_step_line_shows_the_values() -> None:
    m = {
        **_step_metrics(3),
        "reward/mean": 0.4111,
        "eval/accuracy": 0.375,
        "staleness/mean": 0.7,
        "throughput/tokens_per_s": 212.4,
        "throughput/samples_per_s": None,
    }
    line = format_step_line(3, 10, m)
    assert (
        line
        == "step 3/10 | reward 0.41 | acc 0.38 | stale 0.7/2 | 212 tok/s | wait 1.2s train 8.3s push 0.9s"
    )
    assert format_step_line(1, None, {}) == "step 1"
    sparse = format_step_line(2, 5, {"reward/mean": 1, "throughput/samples_per_s": 4.5, "time/train_s": 3})
    assert sparse == "step 2/5 | reward 1.00 | 4.50 samples/s | train 3.0s"


def test_accuracy_interval_is_wilsons() -> None:
    from nodes.driver.metrics import accuracy_interval

    lo, hi = accuracy_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-3)  # not zero-wide at 0
    lo, hi = accuracy_interval(64, 128)
    assert (lo, hi) == (pytest.approx(0.4142, abs=1e-3), pytest.approx(0.5858, abs=1e-3))
    assert accuracy_interval(10, 10)[1] == 1.0 and accuracy_interval(3, 0) == (0.0, 1.0)


def test_step_line_shows_the_eval_interval() -> None:
    m = {"eval/accuracy": 0.5, "eval/ci_low": 0.414, "eval/ci_high": 0.586}
    assert format_step_line(1, 2, m) == "step 1/2 | acc 0.50±0.09"
