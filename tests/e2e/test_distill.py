"""On-policy distillation through the recipe, with the tiny model: a teacher model on a pool of its
own (``[models.teacher]``), named by ``[distill] teacher``, all set from the command line.

One run carries the scenarios: the teacher is the student's own starting weights, so the first
step's ``distill/reverse_kl`` is 0 within float error; then the teacher's server is killed (kill
-9) and the run goes on to its last step, the teacher's pool having launched a replacement. A run
whose teacher has another tokenizer stops before it starts, with one line."""

from __future__ import annotations

import json
import os
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest

from nodes.inference.models import ensure_tiny_checkpoint
from tests.e2e.live_run import LiveRun
from tests.e2e.test_pool import cli
from tests.e2e.test_recipe import ONE_RANK, recipe, rows
from tests.helpers.processes import cmdline

pytestmark = pytest.mark.slow

STEPS = 4


def teacher_args(path: Path) -> list[str]:
    return [
        f"models.teacher.path={path}",
        "distill.teacher=teacher",
        "models.teacher.reference.max_running_requests=16",
    ]


@dataclass
class Distilled:
    returncode: int
    rows: list[dict]
    output: str
    out: Path


@pytest.fixture(scope="module")
def distilled(tmp_path_factory: pytest.TempPathFactory) -> Distilled:
    out = tmp_path_factory.mktemp("distill") / "run"
    tiny = ensure_tiny_checkpoint()  # the student's start: model.tiny=true
    args = [*ONE_RANK, "servers.n=1", *teacher_args(tiny), f"run.steps={STEPS}", f"run.out_dir={out}"]
    with LiveRun(args, out.parent / "err") as run:
        run.until(f"step 1/{STEPS}")
        ls = cli(["pool", "ls", "--json", "--model", "teacher", "--run", str(out)], dict(os.environ))
        assert ls.returncode == 0, ls.stderr
        (teacher,) = json.loads(ls.stdout)["servers"]
        port = teacher["url"].rsplit(":", 1)[1]
        servers = [p for p in run.processes("nodes.inference.server") if f"--port {port}" in cmdline(p)]
        assert len(servers) == 1, [cmdline(p) for p in run.processes("nodes.inference.server")]
        os.kill(servers[0], signal.SIGKILL)
        returncode = run.finish()
        output = run.output() + run.stderr()[-3000:]
    return Distilled(returncode, rows(out), output, out)


@pytest.mark.timeout(900)
def test_the_teacher_at_the_students_start_has_zero_reverse_kl_at_step_one(distilled: Distilled) -> None:
    assert distilled.returncode == 0, distilled.output
    first = distilled.rows[0]
    assert abs(first["distill/reverse_kl"]) < 1e-4, first
    assert first["distill/teacher_time_s"] > 0
    cfg = json.loads((distilled.out / "config.json").read_text())
    assert cfg["distill"]["teacher"] == "teacher" and cfg["models"]["teacher"]["path"] == str(
        ensure_tiny_checkpoint()
    )


@pytest.mark.timeout(900)
def test_a_killed_teacher_server_is_replaced_and_the_run_goes_on(distilled: Distilled) -> None:
    assert distilled.returncode == 0, distilled.output
    assert [r["step"] for r in distilled.rows] == list(range(1, STEPS + 1))
    assert all("distill/reverse_kl" in r for r in distilled.rows)  # every step distilled
    assert (distilled.out / "servers" / "teacher-server-1.log").exists(), distilled.output  # the replacement


@pytest.mark.timeout(300)
def test_a_teacher_with_another_tokenizer_stops_the_run_before_it_starts(tmp_path: Path) -> None:
    other = tmp_path / "other-teacher"
    shutil.copytree(ensure_tiny_checkpoint(), other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]  # two tokens' ids swapped: the same size, another mapping
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    out = tmp_path / "run"
    done = recipe([*ONE_RANK, *teacher_args(other), "run.steps=1", f"run.out_dir={out}"], timeout=240)
    assert done.returncode == 2, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: distill.teacher = 'teacher': its tokenizer"), (
        errors
    )
    assert "2 ids mapped differently" in errors[0]
    assert not out.exists()  # nothing started, nothing written
