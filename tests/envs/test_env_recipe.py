"""Environments trained through the real recipe (tiny model, one reference server, one FSDP2 rank,
weight pushes), 2 steps each, one run per scenario shared by its tests: a verifiers ``SingleTurnEnv``
whose environment raises in half its rollouts (the run goes on; its rubric's rewards), a verifiers
``ToolEnv`` (the tool runs in every episode; the second turn continues the first), an OpenEnv
environment's server started by the run as an actor (env-0) owning a real server process that dies
once (the runtime replaces the actor; the run goes on; nothing is left running after it).
A module that does not import or an unreachable server: exit 2 before anything starts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_recipe import recipe, rows
from tests.envs.test_openenv_env import all_gone, servers_noted

pytest.importorskip("verifiers")
pytest.importorskip("openenv.core")
# a recipe run (its fixture's) is ~1 min idle, several minutes on a loaded 2-core machine
pytestmark = pytest.mark.timeout(900)

BATCH, SAMPLES = 2, 2
COMMON = [
    "model.tiny=true",
    "data.eval_size=4",
    "servers.n=1",  # nothing here needs a second server or rank: each is a process to start
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
VERIFIERS = "rollout.workflow=nodes.rollout.environments:VerifiersWorkflow"


def run(tmp: Path, args: list[str]) -> list[dict[str, Any]]:
    out = tmp / "run"
    done = recipe([*COMMON, *args, f"run.out_dir={out}"], timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    m = rows(out)
    assert [r["step"] for r in m] == [1, 2]
    groups = [g for r in m for g in r["data/groups"].split(",")]
    assert len(groups) == 2 * BATCH and len(set(groups)) == len(groups)  # every group trained once
    for r in m:
        assert r["train/n_seqs"] == BATCH * SAMPLES  # one trajectory per episode
        assert r["rollout/history_edits"] == 0  # every later turn continued the earlier one's ids
    return m


@pytest.fixture(scope="module")
def single_turn(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run(
        tmp_path_factory.mktemp("single"),
        [
            VERIFIERS,
            "rollout.workflow_args.env=tests.envs.sample_env",
            'rollout.workflow_args.env_args={kind = "flaky"}',
            "data.source=env",
        ],
    )


@pytest.fixture(scope="module")
def tool_env(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run(
        tmp_path_factory.mktemp("tool"),
        [
            VERIFIERS,
            "rollout.workflow_args.env=recipes.toy_envs.calculator",
            "rollout.workflow_args.env_args={max_turns = 2, limit = 16}",
            "data.source=env",
            "rollout.workflow_args.tool_parser=tests.envs.always_multiply:parse",
        ],
    )


@pytest.fixture(scope="module")
def openenv(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The run's metrics, and its server processes as each noted itself (tests/envs/openenv_app.py)."""
    tmp = tmp_path_factory.mktemp("openenv")
    with pytest.MonkeyPatch.context() as mp:  # the recipe's processes inherit it, the servers too
        mp.setenv("RLACTORS_TEST_DIE_ONCE", str(tmp / "died"))
        m = run(
            tmp,
            [
                "rollout.workflow=nodes.rollout.environments:OpenEnvWorkflow",
                "rollout.workflow_args.env_app=tests.envs.openenv_app:dying_app",
                "data.source=easy",
            ],
        )
    assert (tmp / "died").exists()  # a server process did die during the run
    return m, servers_noted(tmp / "died")


@pytest.mark.slow
def test_a_single_turn_env_trains_on_its_rubric_and_survives_its_errors(single_turn: list[dict]) -> None:
    for r in single_turn:
        # the rubric's score is the reward: its one function scores every answer 1 (weight 1)
        assert r["reward/mean"] == 1.0 and r["episode/one"] == 1.0 and r["episode/one/weight"] == 1.0
        assert r["episode/length/weight"] == 0.0 and "episode/length" in r  # a metric, weight 0
    # the environment raised in half its rollouts: those groups were dropped, counted, the run went on
    assert single_turn[-1]["rollout/env_errors"] >= 1 and single_turn[-1]["rollout/env_timeouts"] == 0


@pytest.mark.slow
def test_a_tool_env_runs_its_tool_in_every_episode(tool_env: list[dict]) -> None:
    for r in tool_env:
        assert r["episode/total_tool_calls"] == 2.0 and r["episode/multiply_calls"] == 2.0
        assert r["episode/num_turns"] == 2.0
        # the rubric scored the answers (never the product here): correct_answer, weight 1
        assert r["reward/mean"] == r["episode/correct_answer"] and r["episode/correct_answer/weight"] == 1.0
        assert r["rollout/env_errors"] == 0
        # two model turns with the tool's answer between: more tokens than the loss mask covers
        assert r["train/n_tokens"] > r["train/n_loss_tokens"] + r["train/n_seqs"] * 10


@pytest.mark.slow
def test_an_openenv_server_process_trains_and_its_death_does_not_stop_the_run(openenv: tuple) -> None:
    metrics, servers = openenv
    for r in metrics:
        assert r["episode/turns"] == 2.0 and r["episode/env_reward_steps"] == 2.0  # done after 2 steps
        assert 0.0 <= r["reward/mean"] <= 2.0  # the environment's step rewards (<= 1 each), summed
    assert metrics[-1]["rollout/env_errors"] >= 1  # the group on the dying server was dropped
    # the server is the actor env-0's (its worker started it); the runtime replaced the actor when its
    # server died (a new worker started the next server); the run's end left no server running
    assert len(servers) == 2 and all("rlactors.node.worker env-0" in s["parent"] for s in servers)
    assert servers[0]["parent_pid"] != servers[1]["parent_pid"]
    assert all_gone([s["pid"] for s in servers])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([VERIFIERS, "rollout.workflow_args.env=no_such_env_module"], "'rollout.workflow_args.env' = 'no_such_env_module'"),
        ([VERIFIERS, "rollout.workflow_args.env=tests.envs.sample_env",
          'rollout.workflow_args.env_args={kind = "load_fails"}'], "load_environment failed: RuntimeError"),
        (["rollout.workflow=nodes.rollout.environments:OpenEnvWorkflow",
          'rollout.workflow_args.env_urls=["http://127.0.0.1:9"]'], "'http://127.0.0.1:9' does not answer"),
    ],
)  # fmt: skip
def test_an_environment_that_cannot_start_is_one_line_and_exit_2(
    tmp_path: Path, args: list[str], message: str
) -> None:
    out = tmp_path / "run"
    done = recipe([*COMMON, *args, f"run.out_dir={out}"], timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], done.stderr
    assert "Traceback" not in done.stderr and not (out / "config.json").exists()  # nothing started


@pytest.mark.slow
def test_an_environment_whose_rubric_fails_every_episode_stops_the_run_with_one_line(tmp_path: Path) -> None:
    """A rubric that raises on every episode (seen with an upstream environment): exit 2 and one line
    naming the environment, the rubric function and the exception within the first batch, instead of
    a warning per episode until run.batch_timeout_s (set far beyond the test's own timeout here)."""
    out = tmp_path / "run"
    done = recipe(
        [
            *COMMON,
            VERIFIERS,
            "rollout.workflow_args.env=tests.envs.sample_env",
            'rollout.workflow_args.env_args={kind = "raises_in_rubric"}',
            "data.source=env",
            "run.batch_timeout_s=3600",
            f"run.out_dir={out}",
        ],
        timeout=600,
    )
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-3000:]
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("error: workflow nodes.rollout.environments:VerifiersWorkflow failed on ")
    assert (
        "environment tests.envs.sample_env: rubric function raising_score raised ZeroDivisionError" in error
    )
    assert "first failing item: " in error and not (out / "metrics.jsonl").read_text()
    assert (done.stdout + done.stderr).count("rollout.episode_failed") <= 1  # once per kind, then counted


@pytest.mark.slow
def test_evaluate_starts_the_workflows_environment_servers(tmp_path: Path) -> None:
    """``python -m recipes.gsm8k_eval`` with an OpenEnv ``env_app`` starts the environment's servers as
    the run does (the actor env-0 owning a server process), evaluates through them, and leaves none."""
    from nodes.inference.models import ensure_tiny_checkpoint
    from tests.e2e.test_evaluate import evaluate

    marker = tmp_path / "died"
    marker.write_text("")  # the server is to note itself, not to die
    out = tmp_path / "eval"
    with pytest.MonkeyPatch.context() as mp:  # inherited by the evaluation's processes
        mp.setenv("RLACTORS_TEST_DIE_ONCE", str(marker))
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
                "data.source=easy",
                "rollout.workflow_args.max_new_tokens=8",
                "rollout.workflow=nodes.rollout.environments:OpenEnvWorkflow",
                "rollout.workflow_args.env_app=tests.envs.openenv_app:dying_app",
            ],
            timeout=600,
        )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["items"] == 2
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(records) == 2
    servers = servers_noted(marker)  # the episodes ran on a server started by env-0's worker
    assert len(servers) == 1 and "rlactors.node.worker env-0" in servers[0]["parent"]
    assert all_gone([s["pid"] for s in servers])
