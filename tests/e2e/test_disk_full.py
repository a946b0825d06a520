"""A run whose disk fills: on a small tmpfs the second checkpoint does not fit, and the run stops
with exit 2 and one line (the folder, bytes needed and free) before writing it; no partial folder is
left, the first checkpoint is intact and named for ``--resume``; with room again, ``--resume``
continues from it to the end. Mounting needs root: elsewhere the test is skipped, and the injected
ENOSPC of tests/trainer/test_fsdp.py (every rank, either rank's writer) covers the same paths."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodes.inference.models import ensure_tiny_checkpoint
from nodes.trainer.manifest import verify
from tests.e2e.test_recipe import SMALL, recipe, rows

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

ARGS = [
    *SMALL,
    "servers.n=1",
    "trainer.n_ranks=1",
    "run.steps=2",
    "run.eval_every=0",
    "run.checkpoint_every=1",
]


def mount(folder: Path, size: int, remount: bool = False) -> subprocess.CompletedProcess[str]:
    options = f"size={size}" + (",remount" if remount else "")
    return subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True, text=True
    )


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """A tmpfs that holds the run's files and one checkpoint of the tiny model, not two (a
    checkpoint: fp32 weights and AdamW's two moments, about three times the weights file)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; test_fsdp's injected ENOSPC covers the save")
    weights = (ensure_tiny_checkpoint() / "model.safetensors").stat().st_size
    size = int(1.5 * 3 * weights) + (8 << 20)
    disk = tmp_path / "disk"
    disk.mkdir()
    if (done := mount(disk, size)).returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield disk, size
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_checkpoint_that_does_not_fit_stops_the_run_and_resume_continues_with_room(small_disk) -> None:
    disk, size = small_disk
    out = disk / "run"
    done = recipe([*ARGS, f"run.out_dir={out}"], timeout=900)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-3000:]
    error = done.stderr.strip().splitlines()[-1]
    ckpts = out / "checkpoints"
    assert error.startswith(
        f"error: checkpoint {ckpts / 'step-2'}: the disk is full at {ckpts}: it needs about "
    )
    assert "are free; nothing was written; the run stopped; continue from" in error
    assert error.endswith(f"{ckpts / 'step-1'} with --resume once there is room")
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-1"]  # no step-2, no step-2.tmp
    verify(ckpts / "step-1")  # intact: every file as its manifest says
    assert [r["step"] for r in rows(out)] == [1, 2]  # both steps' metrics, whole

    assert mount(disk, 4 * size, remount=True).returncode == 0
    done = recipe([*ARGS, f"run.out_dir={out}", "--resume"], timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "resumed from step 1 " in done.stdout  # from the checkpoint the error named
    assert [r["step"] for r in rows(out)] == [1, 2]
    verify(ckpts / "step-2")
