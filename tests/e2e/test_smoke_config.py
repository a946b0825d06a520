"""recipes/configs/smoke.toml end to end, as a user runs it: the whole pipeline once with the tiny
model, and everything a finished run leaves behind."""

from __future__ import annotations

import math
from pathlib import Path

from recipes.gsm8k_config import load_config
from tests.e2e.test_recipe import ROOT, recipe, rows

SMOKE = ROOT / "recipes" / "configs" / "smoke.toml"


def test_the_smoke_config_runs_the_whole_pipeline(tmp_path: Path) -> None:
    cfg = load_config(str(SMOKE), [])
    assert cfg.model.tiny and cfg.servers.n == 1 and cfg.run.steps == 2  # small, as its header says
    out = tmp_path / "smoke"
    run = recipe(["--config", str(SMOKE), f"run.out_dir={out}"], timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    m = rows(out)
    assert [r["step"] for r in m] == [1, 2]
    for r in m:
        assert r["train/n_seqs"] == 4  # 2 groups x 2 samples trained every step
        assert r["servers/min_weight_version"] == r["step"] == r["version"]  # each push reached the server
    # evaluated before the first step (in the summary line) and on the final weights
    assert m[-1]["eval/version"] == 2 and math.isfinite(m[-1]["eval/accuracy"])
    lines = run.stdout.splitlines()
    assert [line.split(" |")[0] for line in lines if line.startswith("step ")] == ["step 1/2", "step 2/2"]
    assert any(
        line.startswith("eval accuracy ") and "at version 0 →" in line and "at version 2:" in line
        for line in lines
    ), run.stdout

    ckpt = out / "checkpoints" / "step-2"
    assert ckpt.is_dir() and any(ckpt.iterdir())
    assert (out / "checkpoints" / "latest").read_text().strip() == "2"
    assert f"checkpoint {ckpt}" in run.stdout
    for name in ("run.png", "trace.json", "timeline.png", "config.json"):
        assert (out / name).stat().st_size > 0, name
    assert any((out / "tensorboard").iterdir())
