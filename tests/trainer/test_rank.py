"""TrainerRank through the runtime: two actors in one gloo group train, checkpoint and resume."""

from __future__ import annotations

import asyncio
import math

import pytest

from nodes.inference.models import ensure_tiny_checkpoint
from nodes.trainer.rank import TrainerRank, config_from_dict
from nodes.trainer.synthetic import synthetic_batch


def test_config_from_dict_nests_and_names_bad_keys():
    train, push = config_from_dict(
        {
            "model_path": "m",
            "lr": 0.1,
            "betas": [0.8, 0.9],
            "loss": {"eps_clip": 0.3},
            "adv": {"leave_one_out": True},
            "push": {"method": "disk", "pause_mode": "abort"},
        }
    )
    assert (train.lr, train.betas, train.loss.eps_clip, train.adv.leave_one_out) == (
        0.1,
        (0.8, 0.9),
        0.3,
        True,
    )
    assert (push.method, push.pause_mode) == ("disk", "abort")
    with pytest.raises(ValueError, match=r"loss\.eps_clipp"):
        config_from_dict({"loss": {"eps_clipp": 0.3}})
    with pytest.raises(ValueError, match="lrr"):
        config_from_dict({"lrr": 1})


@pytest.mark.slow
async def test_two_rank_actors_train_save_and_load(cluster, tmp_path):
    # bf16 mixed precision and activation checkpointing on: the options run under FSDP2 on gloo
    cfg = {
        "model_path": str(ensure_tiny_checkpoint()),
        "lr": 1e-3,
        "max_tokens_per_mb": 64,
        "warmup_steps": 2,
        "n_minibatches": 2,
        "bf16": True,
        "activation_checkpointing": True,
    }
    ranks = [
        await cluster.spawn(TrainerRank, cfg, name=f"trainer-{i}", env={"OMP_NUM_THREADS": "1"})
        for i in range(2)
    ]
    await cluster.collective_group(ranks, backend="gloo", timeout=120)
    infos = await asyncio.gather(*(r.setup(num_threads=1) for r in ranks))
    assert [i["rank"] for i in infos] == [0, 1] and {i["world_size"] for i in infos} == {2}
    batch = synthetic_batch(4, 2, seed=3, max_lag=0)
    stats = await asyncio.gather(*(r.train_step(batch) for r in ranks))
    assert stats[0]["loss"] == stats[1]["loss"] and math.isfinite(stats[0]["loss"])
    assert stats[0]["lr"] == pytest.approx(1e-3)  # two optimizer steps: warm-up done
    assert stats[0]["n_seqs"] == 8 and stats[0]["grad_norm"] > 0
    path = str(tmp_path / "ckpt")
    await asyncio.gather(*(r.save(path, {"epoch": 0, "index": 8}) for r in ranks))
    await asyncio.gather(*(r.train_step(batch) for r in ranks))
    assert await ranks[0].version() == 2
    states = await asyncio.gather(*(r.load(path) for r in ranks))
    assert states[0]["data_position"] == {"epoch": 0, "index": 8} and states[0]["version"] == 1
    assert await ranks[1].version() == 1
    await asyncio.gather(*(r.close() for r in ranks))
