"""A researcher changes the reward, the advantage estimator and the loss by naming their own in the
config, and the whole pipeline (rollout actors, servers, trainer ranks) runs with them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_recipe import SMALL, recipe, rows


@pytest.mark.slow
def test_pipeline_runs_a_custom_reward_advantage_and_loss(tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = recipe(
        [
            *SMALL,
            "run.steps=2",
            "run.eval_every=0",
            f"run.out_dir={out}",
            "reward.fn=tests.e2e.custom_algorithm:quarter_reward",
            "advantage.fn=tests.e2e.custom_algorithm:rank_advantage",
            "trainer.loss.fn=tests.e2e.custom_algorithm:marked_ppo_loss",
        ]
    )
    assert res.returncode == 0, res.stderr[-3000:]
    m = rows(out)
    assert [r["step"] for r in m] == [1, 2]
    for r in m:
        assert r["reward/mean"] == 0.25  # the custom reward scored every trajectory
        assert r["train/custom/token_share"] == pytest.approx(1.0)  # the custom loss ran on every token
        # the custom advantages reached the loss (GRPO would have given 0 for these equal rewards)
        assert r["train/custom/adv_max"] == 1.0 and r["train/custom/adv_min"] == -1.0
    # the final eval scores with the custom reward too: every greedy answer gets 0.25
    assert m[-1]["eval/accuracy"] == pytest.approx(0.25)
