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
    mark_visible,
    resume_point,
    saved_here,
    unmark,
    verify,
    visibility_error,
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


def test_rank_0_names_each_host_whose_marker_it_does_not_see(tmp_path: Path) -> None:
    # one checkpoint path, two hosts without a shared disk: each sees its own folder at that path
    on_a, on_b = tmp_path / "a" / "step-3.tmp", tmp_path / "b" / "step-3.tmp"
    on_a.mkdir(parents=True)
    on_b.mkdir(parents=True)
    path = Path("/runs/x/checkpoints/step-3")
    hosts = ["node h0 (a)", "node h1 (b)", "node h0 (a)"]
    assert [mark_visible(on_a, 0, "n1"), mark_visible(on_b, 1, "n1"), mark_visible(on_a, 2, "n1")] == [""] * 3
    error = visibility_error(on_a, path, "n1", hosts, [""] * 3)
    assert error.startswith(f"cannot save checkpoint {path}: rank 0 on node h0 (a) does not see")
    assert "by rank 1 on node h1 (b), so" in error and "rank 2" not in error
    assert "run.out_dir" in error and "Nothing was saved" in error
    # a marker left by an earlier save does not count: rank 1 must be seen in this save
    mark_visible(on_a, 1, "n0")
    assert "rank 1 on node h1 (b)" in visibility_error(on_a, path, "n1", hosts, [""] * 3)
    mark_visible(on_a, 1, "n1")  # the same folder for every rank: nothing to report
    assert visibility_error(on_a, path, "n1", hosts, [""] * 3) == ""
    for r in range(3):
        unmark(on_a, r)
    assert list(on_a.iterdir()) == []  # the markers are not part of the checkpoint


def test_a_rank_that_does_not_see_the_folder_creates_nothing_and_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "b" / "step-3.tmp"
    why = mark_visible(missing, 1, "n1")
    assert why == "it does not see the folder rank 0 created" and not (tmp_path / "b").exists()
    (tmp_path / "a").mkdir()
    mark_visible(tmp_path / "a", 0, "n1")
    error = visibility_error(tmp_path / "a", Path("/c/step-3"), "n1", ["h0", "h1"], ["", why])
    assert "by rank 1 on h1 (it does not see the folder rank 0 created)" in error


def test_latest_only_names_a_checkpoint_this_process_sees(tmp_path: Path) -> None:
    ckpt = tmp_path / "step-2"
    ckpt.mkdir()
    with pytest.raises(
        CheckpointError, match=f"checkpoint {re.escape(str(ckpt))} was saved .* does not see it"
    ):
        saved_here(ckpt, "id-2")
    (ckpt / "trainer_state.json").write_text('{"data_position": {"save_id": "id-1"}}')
    with pytest.raises(CheckpointError, match=r"sees an older save there.*latest still names the previous"):
        saved_here(ckpt, "id-2")
    (ckpt / "trainer_state.json").write_text('{"data_position": {"save_id": "id-2"}}')
    saved_here(ckpt, "id-2")
