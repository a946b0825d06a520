"""Trainer ranks for tests/trainer/test_export.py: ``python export_worker.py SCENARIOS OUT_DIR FULL_MODEL
LORA_MODEL``, SCENARIOS ``full``, ``lora`` or ``full,lora`` (one process group for both).

Run with RANK/WORLD_SIZE/MASTER_* set (tests/trainer/launch.py). Each scenario trains one step and
saves a checkpoint as the recipe lays it out (``OUT_DIR/<scenario>/checkpoints/step-1``, beside the
run's ``config.json``), then runs the trained FSDP model on :data:`PROMPTS` (a collective forward);
rank 0 writes those logits to ``OUT_DIR/<scenario>/logits.safetensors``: what an export must reproduce.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from nodes.trainer.config import LoraConfig
from tests.trainer import dist_worker as worker

PROMPTS = [[1, 5, 9, 200, 3000, 17, 4], [1, 42, 43, 44, 45, 46, 47]]  # token ids, equal lengths
LORA = LoraConfig(enabled=True, rank=4, alpha=8.0)


def scenario(name: str, out: Path, model: str) -> None:
    from nodes.trainer import checkpoint
    from nodes.trainer.fsdp import FSDPTrainer

    cfg = worker.train_config(model)
    if name == "lora":  # a high rate: the adapters (B starts at zero) move visibly in one step
        cfg = dataclasses.replace(cfg, lora=LORA, lr=1e-2)
    trainer = FSDPTrainer(cfg)
    worker.train(trainer, worker.batch(1))
    run = out / name
    if dist.get_rank() == 0:
        run.mkdir(parents=True, exist_ok=True)
        (run / "config.json").write_text(json.dumps({"run": {"out_dir": str(run)}, "scenario": name}))
    checkpoint.save(trainer, run / "checkpoints" / "step-1", data_position=1)
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.model(input_ids=torch.tensor(PROMPTS), use_cache=False).logits
    if dist.get_rank() == 0:
        save_file({"logits": logits.contiguous()}, str(run / "logits.safetensors"))


def main() -> None:
    names, out, full_model, lora_model = sys.argv[1].split(","), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    for name in names:
        scenario(name, out, full_model if name == "full" else lora_model)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
