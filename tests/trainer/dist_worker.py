"""A trainer rank for the multi-process tests: ``python dist_worker.py SCENARIO OUT_DIR MODEL``.

Run by tests/trainer/test_fsdp.py with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set, as the runtime
would. Writes what the test compares into OUT_DIR (rank 0 only for full tensors).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def train_config(model: str):
    from nodes.trainer.fsdp import TrainConfig
    from nodes.trainer.loss import LossConfig

    # small micro-batch cap: several micro-batches per rank; a loose cap so some tokens are masked
    return TrainConfig(model_path=model, lr=1e-3, adam_eps=1e-6, weight_decay=0.01, grad_clip=0.5,
                       max_tokens_per_mb=40, loss=LossConfig(eps_clip=0.2, behav_imp_weight_cap=1.5))


def batch(seed: int, n_groups: int = 3):
    from nodes.trainer.synthetic import synthetic_batch

    return synthetic_batch(n_groups, 2, seed=seed, prompt_len=(3, 6), gen_len=(3, 12), max_lag=1)


def save_full(trainer, path: Path) -> None:
    from safetensors.torch import save_file

    sd = trainer.full_state_dict()  # collective
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in sd.items()}, str(path))


def main() -> None:
    scenario, out, model = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    from nodes.trainer import checkpoint
    from nodes.trainer.fsdp import FSDPTrainer

    trainer = FSDPTrainer(train_config(model))
    rank = dist.get_rank()
    if scenario == "fresh":
        stats = trainer.train_step(batch(1))
        if rank == 0:
            (out / "stats1.json").write_text(json.dumps(stats))
        save_full(trainer, out / "step1.safetensors")
        checkpoint.save(trainer, out / "ckpt", data_position=1)
        torch.rand(3)  # RNG advances after the checkpoint; resume must restore the saved state
        trainer.train_step(batch(2, n_groups=1))  # one group on two ranks: rank 1 runs dummy micro-batches
        save_full(trainer, out / "step2.safetensors")
    elif scenario == "resume":
        extra = checkpoint.load(trainer, out / "ckpt")
        if rank == 0:
            (out / "resume.json").write_text(json.dumps({"data_position": extra.data_position,
                                                         "version": trainer.version,
                                                         "optim_steps": trainer.optim_steps}))
        trainer.train_step(batch(2, n_groups=1))
        save_full(trainer, out / "step2_resumed.safetensors")
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
