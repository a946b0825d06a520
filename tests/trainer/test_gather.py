"""Rank 0 assembles full parameters from 2 FSDP ranks for the weight push.

Ranks on rank 0's host write their rows into rank 0's buffers through a shared-memory file;
ranks that cannot (or will not) map it send them point to point. Either way rank 0 ends up with
every parameter exactly, in several reused buckets, before and after a training step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nodes.inference.models import ensure_tiny_checkpoint
from tests.trainer.launch import run_ranks

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def gathered(tmp_path_factory) -> tuple[dict, dict]:
    out = tmp_path_factory.mktemp("gather")
    run_ranks(
        HERE / "dist_worker.py", ["gather", str(out), str(ensure_tiny_checkpoint())], world=2, timeout=240
    )
    return tuple(json.loads((out / f"gather{r}.json").read_text()) for r in (0, 1))


@pytest.mark.slow
@pytest.mark.parametrize(
    "case, shared",
    [
        ("shm", [1]),  # same host: rank 1 writes into rank 0's /dev/shm buffers
        ("shm_tmpdir_bf16", [1]),  # any shared directory works; rows are cast on the way in
        ("rank1_refuses", []),  # rank 1 cannot map the file: it sends instead
        ("no_shm_dir", []),  # rank 0 cannot create it: everyone sends
        ("disabled", []),
    ],
)
def test_rank0_gets_every_parameter_exactly(gathered, case, shared):
    r0, r1 = gathered
    assert r0[case]["shared_ranks"] == shared and r1[case]["shared_ranks"] == shared
    assert r0[case]["buckets"] > 2  # the two buffers are reused
    assert r0[case]["equal"] == [True, True]  # before and after a training step


@pytest.mark.slow
def test_shared_memory_file_is_unlinked_once_mapped(gathered):
    r0, _ = gathered
    assert r0["shm_tmpdir_bf16"]["leftover_files"] == []
