"""A researcher changes the reward, the advantage estimator and the loss by naming their own in the
config, and the whole pipeline (rollout actor, server, trainer rank) runs with them.

The same run has keys forced on loopback (``servers.reference.auth = "on"``): every client of the
server sends the key its calls need (rollout, policy sync, weight push, health checks, evaluation),
or the run fails with 401s. The two do not interfere (the keys are the transport's, the algorithm is
the trainer's), so one run of 2 steps on one server and one rank proves both."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.e2e.test_recipe import SMALL, recipe, rows


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run's out_dir: 2 steps with the custom reward, advantage and loss against a keyed server."""
    out = tmp_path_factory.mktemp("custom") / "run"
    res = recipe(
        [
            *SMALL,
            "servers.n=1",
            "trainer.n_ranks=1",
            "run.steps=2",
            "run.eval_every=0",
            "run.checkpoint_every=0",
            f"run.out_dir={out}",
            "reward.fn=tests.e2e.custom_algorithm:quarter_reward",
            "advantage.fn=tests.e2e.custom_algorithm:rank_advantage",
            "trainer.loss.fn=tests.e2e.custom_algorithm:marked_ppo_loss",
            "servers.reference.auth=on",
            'servers.reference.extra_args=["--log-level", "info"]',  # uvicorn's access log: every request
        ],
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert [r["step"] for r in rows(out)] == [1, 2]
    # SMALL turns the end-of-run plots off: none drawn, and the last line says why
    assert "plot - (metrics.plots = false)" in res.stdout, res.stdout[-2000:]
    assert not (out / "run.png").exists() and not (out / "timeline.png").exists()
    return out


@pytest.mark.slow
def test_pipeline_runs_a_custom_reward_advantage_and_loss(run: Path) -> None:
    m = rows(run)
    for r in m:
        assert r["reward/mean"] == 0.25  # the custom reward scored every trajectory
        assert r["train/custom/token_share"] == pytest.approx(1.0)  # the custom loss ran on every token
        # the custom advantages reached the loss (GRPO would have given 0 for these equal rewards)
        assert r["train/custom/adv_max"] == 1.0 and r["train/custom/adv_min"] == -1.0
    # the final eval scores with the custom reward too: every greedy answer gets 0.25
    assert m[-1]["eval/accuracy"] == pytest.approx(0.25)


@pytest.mark.slow
def test_recipe_runs_against_keyed_servers(run: Path) -> None:
    m = rows(run)
    for r in m:
        assert r["servers/min_weight_version"] == r["step"] == r["version"]  # every push landed
    assert m[-1]["eval/version"] == 2 and m[-1]["eval/accuracy"] == m[-1]["eval/accuracy"]  # eval ran
    log = (run / "servers" / "server-0.log").read_text(errors="replace")
    assert "keys=api_key,admin_api_key" in log  # the server took both keys
    statuses = re.findall(r'"(?:GET|POST) (\S+) HTTP/1.1" (\d+)', log)
    seen = {path for path, _ in statuses}
    assert {
        "/generate",
        "/pause_generation",
        "/continue_generation",
        "/init_weights_update_group",
        "/update_weights_from_distributed",
        "/health",
        "/model_info",
    } <= seen, seen
    assert not [s for s in statuses if s[1] == "401"], [s for s in statuses if s[1] == "401"][:5]
