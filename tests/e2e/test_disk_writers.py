"""A full disk never corrupts what was already written (nodes/common/disk.py): a metrics line or a
trace write cut short by ENOSPC is taken back and raises DiskFullError with one line, so
metrics.jsonl and trace.json keep every whole record before it; torch's checkpoint failures that
wrap ENOSPC are recognised as a full disk."""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

import pytest

from nodes.common.disk import DiskFullError, append_whole, check_room, is_disk_full
from nodes.common.trace import TraceWriter, read_trace
from nodes.driver.metrics import MetricsLogger, read_metrics


class FillsUp:
    """A file whose next write gets half its bytes onto the disk, then ENOSPC."""

    def __init__(self, f: Any) -> None:
        self.f, self.name = f, f.name

    def write(self, data: Any) -> int:
        self.f.write(bytes(data)[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)


def test_a_metrics_line_that_does_not_fit_is_taken_back(tmp_path: Path) -> None:
    m = MetricsLogger(tmp_path, tensorboard=False)
    m.log(1, {"reward/mean": 0.5})
    m._file = FillsUp(m._file)
    with pytest.raises(
        DiskFullError,
        match=rf"^metrics of step 2: the disk is full at {tmp_path}: it needs about "
        rf"[\d,]+ bytes, [\d,]+ are free; {tmp_path / 'metrics.jsonl'} kept as it was$",
    ):
        m.log(2, {"reward/mean": 0.75, "text": "x" * 1000})
    m._file = m._file.f
    m.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    assert text.endswith("\n") and [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1]
    assert len(text.splitlines()) == 1  # no torn half line


def test_a_trace_write_that_does_not_fit_leaves_the_events_before(tmp_path: Path) -> None:
    t = TraceWriter(tmp_path / "trace.json")
    event = {"proc": "driver", "thread": "main", "ph": "X", "name": "step", "ts": 1, "dur": 2}
    t.write([dict(event)])
    t._file = FillsUp(t._file)
    with pytest.raises(DiskFullError, match="the run's timeline: the disk is full"):
        t.write([dict(event, name="next", ts=5 + i) for i in range(50)])
    t._file = t._file.f
    t.close()
    assert [e["name"] for e in read_trace(tmp_path / "trace.json") if e["ph"] == "X"] == ["step"]
    json.loads((tmp_path / "trace.json").read_text())  # closed: still strict JSON


def test_append_whole_and_check_room(tmp_path: Path) -> None:
    with (tmp_path / "f").open("ab", buffering=0) as f:
        append_whole(f, "whole\n", "a file")
    assert (tmp_path / "f").read_text() == "whole\n"
    with pytest.raises(
        DiskFullError,
        match=rf"^export x: the disk is full at {tmp_path}: it needs about "
        r"[\d,]+ bytes, [\d,]+ are free; nothing was written$",
    ):
        check_room("export x", tmp_path, 1 << 62)


def test_torchs_wrapped_enospc_is_a_full_disk(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    try:
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError as e:
        wrapped = CheckpointException("save failed", {1: _wrap_exception(e)})
    assert is_disk_full(wrapped) and is_disk_full(RuntimeError("x"), tmp_path) is False
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))
    try:
        raise RuntimeError("write failed") from OSError(errno.EDQUOT, "Disk quota exceeded")
    except RuntimeError as e:
        assert is_disk_full(e)
