"""``python -m recipes.gsm8k_eval``: a checkpoint or an exported folder evaluated with the run's own
evaluator, on the config's held-out items or on data of your choice, by servers it starts or a
server already running; per-item results and a summary on disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.learning_reward import TOKENS
from tests.e2e.test_recipe import ROOT, SMALL, recipe, rows
from tests.e2e.test_your_data import HELD, jsonl
from tests.helpers import forked
from tests.helpers.servers import reference_server

# A reward that depends on every generated token, and greedy decoding: the same weights give the same
# score, different weights (almost surely) another. One server and one rank, in the run and in the
# evaluation: a second of each is one more process to start and proves nothing here.
SCORED = [
    *SMALL,
    "servers.n=1",
    "trainer.n_ranks=1",
    "reward.fn=tests.e2e.learning_reward:no_space_share",
    f"rollout.workflow_args.max_new_tokens={TOKENS}",
    "run.eval_temperature=0",
]


def evaluate(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return forked.run(
        [sys.executable, "-m", "recipes.gsm8k_eval", *args],
        preload=forked.DRIVER,
        cwd=ROOT,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT), "RLACTORS_LOG_LEVEL": "WARNING"},
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of one step (tiny model, a large learning rate so the weights move) whose final
    evaluation is the reference; its checkpoint is what we evaluate again."""
    out = tmp_path_factory.mktemp("evaluate") / "run"
    res = recipe([*SCORED, "run.steps=1", "run.eval_every=0", "trainer.lr=0.05", f"run.out_dir={out}"])
    assert res.returncode == 0, res.stderr[-3000:]
    return out


@pytest.mark.slow
def test_a_checkpoint_scores_what_the_run_scored_at_that_step(trained: Path, tmp_path: Path) -> None:
    final = rows(trained)[-1]
    assert final["eval/version"] == 1
    res = evaluate(["--model", str(trained / "checkpoints" / "step-1"), "--out", str(tmp_path), *SCORED])
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["items"] == final["eval/n"] == 4
    assert summary["accuracy"] == pytest.approx(final["eval/accuracy"], abs=1e-9)
    assert (summary["ci_low"], summary["ci_high"]) == pytest.approx(
        (final["eval/ci_low"], final["eval/ci_high"])
    )
    assert f"accuracy {summary['accuracy']:.3f}" in res.stdout
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(results) == 4 and all(len(r["samples"]) == 1 for r in results)
    assert sum(r["reward"] for r in results) / 4 == pytest.approx(summary["accuracy"])
    assert all(r["question"] and r["answer"] and r["samples"][0]["completion"] is not None for r in results)
    assert (tmp_path / "model" / "config.json").is_file()  # the checkpoint was exported to be served


@pytest.mark.slow
def test_an_exported_folder_on_your_data_through_a_running_server(trained: Path, tmp_path: Path) -> None:
    """Another door in: the folder ``rlactors export`` wrote, data given with --data, and a server
    already running (--server-url); the reward reads the row's own columns, samples at 0.7."""
    folder = tmp_path / "hf"
    exported = subprocess.run(
        [
            sys.executable,
            "-m",
            "nodes.trainer.export",
            str(trained / "checkpoints" / "step-1"),
            "--out",
            str(folder),
            "--dtype",
            "fp32",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert exported.returncode == 0, exported.stderr[-2000:]
    data = jsonl(tmp_path / "held.jsonl", HELD)
    with reference_server(["--model-path", str(folder), "--backend", "hf"]) as url:
        res = evaluate(
            [
                "--model",
                str(folder),
                "--data",
                str(data),
                "--server-url",
                url,
                "--n",
                "2",
                "--temperature",
                "0.7",
                "--out",
                str(tmp_path / "ev"),
                "data.prompt_field=q",
                "data.answer_field=a",
                "data.answer_format=gsm8k",
                "reward.fn=tests.e2e.custom_data:weight_if_fields_arrived",
                "model.tiny=true",
            ]
        )
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((tmp_path / "ev" / "summary.json").read_text())
    assert (summary["items"], summary["samples_per_item"], summary["temperature"]) == (6, 2, 0.7)
    assert summary["accuracy"] == pytest.approx(0.5) and summary["servers"] == [url]
    results = [json.loads(line) for line in (tmp_path / "ev" / "results.jsonl").read_text().splitlines()]
    assert [r["id"] for r in results] == [f"data-test-{i}" for i in range(6)]
    assert all(len(r["samples"]) == 2 for r in results)


def test_bad_inputs_are_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The first case as a user meets it (``python -m recipes.gsm8k_eval``: the exit status the shell
    sees); the others through the same ``main`` in this process, without a process start-up each."""
    from recipes.gsm8k_eval import main

    out = ["--out", str(tmp_path / "out")]
    res = evaluate(["--model", str(tmp_path), *out], timeout=120)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-2000:]
    assert "not a Hugging Face model folder" in lines[0], res.stderr[-2000:]
    for args, message in (
        (["--model", str(tmp_path), "trainer.lr=fast"], "'trainer.lr' must be a float"),
        (["--model", str(tmp_path), "--n", "0"], "--n must be >= 1"),
        (["--model", str(tmp_path), "--data", str(tmp_path / "none.jsonl")], "no such file or folder"),
    ):
        code = main([*args, *out])
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and message in lines[0], (args, err[-2000:])
