"""The trainer trains: through the real pipeline (a reference server with a real model, rollout,
governor, buffer, an FSDP2 rank, weight pushes, asynchronous with staleness 1), a reward with an
unambiguous optimum (tests/e2e/learning_reward.py) rises over a few steps (on a tiny model with a
feature the reward can use, so that it rises from the first steps in every run), and the same run with
the advantage negated (reward scaled by -10 instead of 10) does not rise (it falls). This catches
what unit tests of formulas cannot: a flipped sign, a lost weight push, a stale-policy mix-up, a broken normalisation.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nodes.driver.data import PROMPT_SUFFIX, SYSTEM_PROMPT
from tests.e2e.learning_reward import TOKENS, featured_checkpoint
from tests.e2e.test_recipe import recipe, rows

# Steps 1-2 train on version-0 samples; the featured model rises over steps 3-5 (bench/RESULTS.md has
# a run's curve): 6 steps leave four to compare the signs over.
STEPS = 6


def run(tmp_path: Path, name: str, scaling: float) -> list[dict]:
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    for split, first, n in (("train", 0, 64), ("test", 100, 8)):  # short prompts: the reward ignores them
        lines = [json.dumps({"question": str(i), "answer": "#### 0"}) for i in range(first, first + n)]
        (data / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / name
    model = tmp_path / "model"
    args = [
        f"model.path={model if model.exists() else featured_checkpoint(model)}",
        "data.source=local",
        f"data.path={data}",
        "data.eval_size=8",
        "servers.n=1",
        "trainer.n_ranks=1",
        "trainer.lr=0.08",  # a random-weight model learns this objective only with large steps
        "advantage.shaping.bias=-0.5",
        f"advantage.shaping.scale={scaling}",
        "async.batch_size=8",
        "async.max_staleness=1",
        "rollout.workflow_args.n_samples=4",
        f"rollout.workflow_args.max_new_tokens={TOKENS}",
        # pinned: the CPU default's values are tuned for SmolLM2, this test's for its tiny model
        "rollout.workflow_args.temperature=1.0",
        "run.eval_temperature=0.6",
        # the prompt this test was calibrated with (your data gets none by default): on bare prompts
        # the featured model's training reward still rises, but its held-out one at 0.6 does not
        f"rollout.workflow_args.system_prompt={SYSTEM_PROMPT}",
        f"rollout.workflow_args.prompt_suffix={json.dumps(PROMPT_SUFFIX)}",
        "run.eval_every=0",
        "servers.reference.max_running_requests=64",
        "async.max_concurrent=64",
        "trainer.max_tokens_per_mb=4096",
        "reward.fn=tests.e2e.learning_reward:no_space_share",
        f"run.steps={STEPS}",
        "run.checkpoint_every=0",
        "metrics.plots=false",
        "metrics.tensorboard=false",
        f"run.out_dir={out}",
    ]
    done = recipe(args, timeout=800)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    m = rows(out)
    assert [r["step"] for r in m] == list(range(1, STEPS + 1))
    return m


def reward(m: list[dict], steps: slice) -> float:
    xs = [r["reward/mean"] for r in m[steps]]
    return sum(xs) / len(xs)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # two runs: ~2 min each idle, 5+ min each on a loaded 2-core machine
def test_reward_rises_and_falls_with_the_advantage_sign(tmp_path: Path) -> None:
    up = run(tmp_path, "up", 10.0)
    down = run(tmp_path, "down", -10.0)
    start = reward(up, slice(0, 2))  # steps 1-2 train on version-0 samples in both runs
    assert abs(reward(down, slice(0, 2)) - start) < 0.1
    ups, downs = [r["reward/mean"] for r in up], [r["reward/mean"] for r in down]
    # the two signs are compared over the steps after the first two (which train on version-0
    # samples): a wrong sign, a lost push or a stale-policy mix-up makes them equal or reversed
    assert reward(up, slice(2, None)) > reward(down, slice(2, None)) + 0.1, (ups, downs)
    assert max(ups[2:]) > start + 0.15, (ups, downs)
    assert up[-1]["eval/accuracy"] > down[-1]["eval/accuracy"] + 0.1, (ups, downs)
