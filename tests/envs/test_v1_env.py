"""verifiers v1 tasksets trained through the real recipe (tiny model, one reference server, one FSDP2
rank, weight pushes), in a Python environment of their own: tests/envs/v1_sums (an offline taskset
whose ``@vf.reward`` checks a sum) installed as a local package beside ``verifiers==0.4.0``; its
env server dies once mid-run (the actor ``env-0`` is replaced, the run goes on).
The environment is made once per requirement set (under ``$RLACTORS_CACHE``; CI keeps it between
runs). A taskset that does not resolve, a package that does not install, a verifiers whose wire
does not match: one line and exit 2 before anything starts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_recipe import recipe, rows

pytestmark = pytest.mark.timeout(900)

BATCH, SAMPLES = 2, 2
V1 = [
    "rollout.workflow=nodes.rollout.environments:VerifiersV1Workflow",
    "rollout.workflow_args.taskset=rlactors-v1-sums",
    'rollout.workflow_args.packages=["tests/envs/v1_sums"]',
    "data.source=env",
]
COMMON = [
    "model.tiny=true",
    "data.eval_size=4",
    "servers.n=1",
    "trainer.n_ranks=1",
    f"async.batch_size={BATCH}",
    "async.max_staleness=1",
    f"rollout.workflow_args.n_samples={SAMPLES}",
    "rollout.workflow_args.max_new_tokens=8",
    "servers.reference.max_running_requests=16",
    "run.steps=2",
    "run.eval_every=0",
    "run.checkpoint_every=0",
    "metrics.plots=false",
    "metrics.tensorboard=false",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Two steps on the taskset whose every other task's scoring raises, and whose env server dies
    once (the first scoring: tests/envs/v1_sums notes it in ``died``)."""
    tmp = tmp_path_factory.mktemp("v1")
    out = tmp / "run"
    with pytest.MonkeyPatch.context() as mp:  # the recipe's processes inherit it, the env servers too
        mp.setenv("RLACTORS_TEST_V1_DIE_ONCE", str(tmp / "died"))
        done = recipe(
            [
                *COMMON,
                *V1,
                "rollout.workflow_args.env_config={taskset = {fail_odd = true}}",
                f"run.out_dir={out}",
            ],
            timeout=900,
        )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert (tmp / "died").exists()  # verifiers' env server did die during the run
    return rows(out)


@pytest.mark.slow
def test_a_v1_taskset_trains_on_its_rewards_in_its_own_environment(trained: list[dict[str, Any]]) -> None:
    assert [r["step"] for r in trained] == [1, 2]
    groups = [g for r in trained for g in r["data/groups"].split(",")]
    assert len(groups) == 2 * BATCH and len(set(groups)) == len(groups)  # every group trained once
    for r in trained:
        assert r["train/n_seqs"] == BATCH * SAMPLES  # one trace, one token sequence, per episode
        assert r["rollout/history_edits"] == 0  # each trace's calls continued its own sequence
        # the @vf.reward's score is the reward (weight 1); the @vf.metric reaches the metrics too
        assert r["reward/mean"] == r["episode/correct"] and r["episode/correct/weight"] == 1.0
        assert r["episode/reply_chars"] > 0
        assert r["train/n_loss_tokens"] > 0
    # half the tasks' scoring raises, and the env server died once (its actor env-0 was replaced): those
    # groups were dropped, counted, and the run went on
    assert trained[-1]["rollout/env_errors"] >= 1 and trained[-1]["rollout/env_timeouts"] == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([*V1, "rollout.workflow_args.taskset=no-such-taskset"], "taskset 'no-such-taskset' not found"),
        (
            [*V1, 'rollout.workflow_args.packages=["/nonexistent/rlactors-pkg"]'],
            "packages': could not install verifiers==0.4.0 uv /nonexistent/rlactors-pkg",
        ),
        ([*V1, "rollout.workflow_args.verifiers=0.3.1"], "wire does not match"),
    ],
)
def test_a_v1_environment_that_cannot_start_is_one_line_and_exit_2(
    tmp_path: Path, args: list[str], message: str
) -> None:
    out = tmp_path / "run"
    done = recipe([*COMMON, *args, f"run.out_dir={out}"], timeout=600)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], done.stderr
    assert "Traceback" not in done.stderr and not (out / "config.json").exists()  # nothing started


@pytest.mark.slow
def test_evaluate_runs_a_v1_taskset_through_its_env_servers(tmp_path: Path) -> None:
    """``python -m recipes.gsm8k_eval`` on the taskset: the same servers and bridge, its rewards."""
    from nodes.inference.models import ensure_tiny_checkpoint
    from tests.e2e.test_evaluate import evaluate

    out = tmp_path / "eval"
    done = evaluate(
        [
            "--model",
            str(ensure_tiny_checkpoint()),
            "--limit",
            "2",
            "--out",
            str(out),
            "model.tiny=true",
            "servers.n=1",
            "rollout.workflow_args.max_new_tokens=8",
            *V1,
            "data.eval_from_train=2",
        ],
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["items"] == 2
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(records) == 2
    # the taskset's @vf.reward (0 or 1 per answer) is what the evaluation scored
    assert all(r["reward"] in (0.0, 1.0) for r in records)
    assert sum(r["reward"] for r in records) / 2 == pytest.approx(
        json.loads((out / "summary.json").read_text())["accuracy"]
    )
