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


def run_gather(out: Path, world: int) -> list[dict]:
    run_ranks(
        HERE / "dist_worker.py", ["gather", str(out), str(ensure_tiny_checkpoint())], world=world, timeout=240
    )
    return [json.loads((out / f"gather{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def gathered(tmp_path_factory) -> list[dict]:
    return run_gather(tmp_path_factory.mktemp("gather"), world=2)


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
def test_buckets_of_several_dtypes_share_memory(gathered):
    r0, r1 = gathered
    assert r0["mixed_dtypes"]["shared_ranks"] == r1["mixed_dtypes"]["shared_ranks"] == [1]
    assert r0["mixed_dtypes"]["buckets"] == 2 and r0["mixed_dtypes"]["equal"] == [True]


@pytest.mark.slow
def test_three_ranks_one_sending_point_to_point(tmp_path):
    results = run_gather(tmp_path, world=3)
    assert [r["shm"]["shared_ranks"] for r in results] == [[1, 2]] * 3
    assert [r["rank2_refuses"]["shared_ranks"] for r in results] == [[1]] * 3  # rank 2 knows too
    assert results[0]["shm"]["equal"] == results[0]["rank2_refuses"]["equal"] == [True, True]


@pytest.mark.slow
def test_shared_memory_file_is_unlinked_once_mapped(gathered):
    r0, _ = gathered
    assert r0["shm_tmpdir_bf16"]["leftover_files"] == []
