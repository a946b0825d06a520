"""A run whose reward comes from a reward model on a pool of its own (``[models.rm]``), set from the
command line: the tiny random-weight LlamaForSequenceClassification, launched by the run on a
reference server that serves it on ``/classify``, scores every completion (its chat template
over the item's question and the completion), and the run trains to its end (the plumbing: the
model's pool and its health probe, the reward function in the rollout actor and in the driver's
evaluation, the counters in the metrics)."""

from __future__ import annotations

import pytest

from tests.e2e.test_recipe import ONE_RANK, recipe, rows
from tests.helpers.classifier import tiny_classifier

pytestmark = pytest.mark.slow


@pytest.mark.timeout(600)
def test_a_reward_model_scores_a_run(tmp_path) -> None:
    out = tmp_path / "run"
    rm = [
        f"models.rm.path={tiny_classifier(tmp_path / 'rm')}",
        "reward.fn=nodes.rollout.judge:reward_model",
        "reward.fn_args.judge=rm",
        "reward.fn_args.transform=sigmoid",
        "reward.fn_args.default=-1.0",  # a failed score would pull the mean below 0
    ]
    done = recipe([*ONE_RANK, "servers.n=1", *rm, "run.steps=2", f"run.out_dir={out}"])
    assert done.returncode == 0, done.stderr[-3000:]
    last = rows(out)[-1]
    assert last["reward/judge_calls"] >= 1
    assert last["reward/judge_errors"] == 0, [
        line for line in done.stderr.splitlines() if "judge.error" in line
    ]
    means = [r["reward/mean"] for r in rows(out) if "reward/mean" in r]
    assert means and all(0.0 < m < 1.0 for m in means)  # sigmoids of the model's numbers, none a default
