"""TrainerRank through the runtime: two actors in one gloo group train, checkpoint and resume."""

from __future__ import annotations

import math

import pytest

import rlactors
from nodes.inference.models import ensure_tiny_checkpoint
from nodes.trainer.config import LossConfig, PushConfig, TrainConfig
from nodes.trainer.rank import TrainerRank
from protocols.runtime.codec import decode, encode
from tests.helpers.synthetic import synthetic_batch, with_advantages


def test_the_config_travels_as_it_is_and_checks_its_values():
    cfg = TrainConfig(
        lr=0.1,
        betas=(0.8, 0.9),
        loss=LossConfig(eps_clip=0.3),
        push=PushConfig(method="disk", pause_mode="abort"),
    )
    back = decode(encode(cfg))
    assert back == cfg and isinstance(back.loss, LossConfig) and back.betas == (0.8, 0.9)
    with pytest.raises(ValueError, match="'eps_clip' must be in"):
        LossConfig(eps_clip=1.5)
    with pytest.raises(ValueError, match="'n_ranks' must be >= 1"):
        TrainConfig(n_ranks=0)


@pytest.mark.slow
async def test_two_rank_actors_train_save_and_load(cluster, tmp_path):
    # bf16 mixed precision and activation checkpointing on: the options run under FSDP2 on gloo
    cfg = TrainConfig(
        model_path=str(ensure_tiny_checkpoint()),
        lr=1e-3,
        max_tokens_per_mb=64,
        warmup_steps=2,
        n_minibatches=2,
        bf16=True,
        activation_checkpointing=True,
    )
    ranks = rlactors.ActorGroup(
        [
            await cluster.spawn(TrainerRank, cfg, name=f"trainer-{i}", env={"OMP_NUM_THREADS": "1"})
            for i in range(2)
        ]
    )
    await cluster.collective_group(list(ranks), backend="gloo", timeout=120)
    infos = await ranks.setup()
    assert [i["rank"] for i in infos] == [0, 1] and {i["world_size"] for i in infos} == {2}
    batch = synthetic_batch(4, 2, seed=3, max_lag=0)
    stats = await ranks.train_step(with_advantages(batch))
    assert stats[0]["loss"] == stats[1]["loss"] and math.isfinite(stats[0]["loss"])
    assert stats[0]["lr"] == pytest.approx(1e-3)  # two optimizer steps: warm-up done
    assert stats[0]["n_seqs"] == 8 and stats[0]["grad_norm"] > 0
    path = str(tmp_path / "ckpt")
    await ranks.save(path, {"epoch": 0, "index": 8})
    await ranks.train_step(with_advantages(batch))
    assert await ranks[0].version() == 2
    states = await ranks.load(path)
    assert states[0]["data_position"] == {"epoch": 0, "index": 8} and states[0]["version"] == 1
    assert await ranks[1].version() == 1
    await ranks.close()
