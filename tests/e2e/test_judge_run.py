"""A run whose reward comes from an LLM judge on a pool of its own (``[models.judge]``), set from the
command line: the tiny random model as the judge answers nothing a parser can read, so every
judgement is a counted failure scored ``on_error``'s default, logged once per process, and the
run trains to its end (the plumbing: the judge's pool, its client in the rollout actor and in the
driver's evaluation, the counters in the metrics)."""

from __future__ import annotations

import pytest

from nodes.inference.models import ensure_tiny_checkpoint
from tests.e2e.test_recipe import ONE_RANK, recipe, rows

pytestmark = pytest.mark.slow


@pytest.mark.timeout(600)
def test_a_judged_run_counts_what_its_judge_could_not_score(tmp_path) -> None:
    out = tmp_path / "run"
    judge = [
        f"models.judge.path={ensure_tiny_checkpoint()}",
        "reward.fn=nodes.rollout.judge:judge",
        "reward.fn_args.judge=judge",
        "reward.fn_args.parser=score",
        "reward.fn_args.template=Rate this answer from 0 to 9: {completion} Score:",
        "reward.fn_args.default=0.0",
    ]
    done = recipe([*ONE_RANK, "servers.n=1", *judge, "run.steps=2", f"run.out_dir={out}"])
    assert done.returncode == 0, done.stderr[-3000:]
    last = rows(out)[-1]
    trained = sum(r["train/n_seqs"] for r in rows(out))
    assert last["reward/judge_calls"] >= 1
    assert last["reward/judge_time_s"] > 0.0  # what a judgement costs, its failures' included
    assert last["reward/judge_errors"] >= trained  # every judgement the rollout made failed, counted
    assert last["reward/mean"] == 0.0  # scored the default
    logged = [line for line in done.stderr.splitlines() if "judge.error" in line]
    assert 1 <= len(logged) <= 2, logged  # once per process that judged (the rollout actor, the driver)
