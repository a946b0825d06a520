"""Checkpoint integrity without torch: the sha256 manifest, the atomic ``latest`` pointer, and the
resume point checked before a run starts anything."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from nodes.trainer.manifest import (
    CheckpointError,
    hash_files,
    resume_point,
    verify,
    write_latest,
    write_manifest,
)


def make_checkpoint(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(bytes(range(256)) * 8)
    (folder / "__1_0.distcp").write_bytes(b"\x01" * 3000)
    (folder / "trainer_state.json").write_text("{}")
    shares = [hash_files(folder, (r, 2)) for r in (0, 1)]  # two ranks hash half each
    write_manifest(folder, {k: v for s in shares for k, v in s.items()})
    return folder


def test_a_changed_byte_is_an_error_naming_the_file(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "step-2")
    verify(ckpt)
    shard = ckpt / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[1000:1008] = b"\xff" * 8  # same size, different bytes
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{re.escape(str(shard))}.*sha256"):
        verify(ckpt)
    # each rank checks its share: the error is on the share that holds the file
    shares = []
    for r in (0, 1):
        try:
            verify(ckpt, (r, 2))
            shares.append(None)
        except CheckpointError as e:
            shares.append(str(e))
    assert sum(s is not None for s in shares) == 1


def test_missing_file_or_manifest_is_an_error(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "step-2")
    (ckpt / "trainer_state.json").unlink()
    with pytest.raises(CheckpointError, match=r"trainer_state\.json is missing"):
        verify(ckpt)
    (ckpt / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"has no manifest\.json"):
        verify(ckpt)
    (ckpt / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"manifest\.json is unreadable"):
        verify(ckpt)


def test_latest_is_replaced_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_latest(tmp_path, 2)
    write_latest(tmp_path, 4)
    assert (tmp_path / "latest").read_text() == "4\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]

    def crash(src: object, dst: object) -> None:  # the process dies between write and rename
        raise OSError("simulated crash")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        write_latest(tmp_path, 6)
    assert (tmp_path / "latest").read_text() == "4\n"  # the old pointer, never an empty file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_resume_point_is_checked_and_errors_say_what_is_there(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "step-2")
    make_checkpoint(tmp_path / "step-4")
    write_latest(tmp_path, 4)
    assert resume_point(tmp_path) == (4, tmp_path / "step-4")
    (tmp_path / "latest").write_text("")
    with pytest.raises(CheckpointError, match=r"found ''.*step-2, step-4"):
        resume_point(tmp_path)
    (tmp_path / "latest").write_text("9")
    with pytest.raises(CheckpointError, match=r"names step 9, but .*step-9 does not exist"):
        resume_point(tmp_path)
    (tmp_path / "latest").unlink()
    with pytest.raises(CheckpointError, match=r"nothing to resume"):
        resume_point(tmp_path)
