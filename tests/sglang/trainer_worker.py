"""A trainer rank pushing into SGLang's own receive code: ``python trainer_worker.py OUT MODEL URL``.

Run by test_sglang_code.py with RANK/WORLD_SIZE/MASTER_* set. After one training step the ranks
push the model three times: as a flattened bucket and one tensor at a time over the group, then by
reference (``/update_weights_from_tensor``); after each push rank 0 has the server save what it
received, and saves the trainer's full weights beside it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import torch
import torch.distributed as dist


def main() -> None:
    out, model, url = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    from safetensors.torch import save_file

    from nodes.trainer.config import TrainConfig
    from nodes.trainer.fsdp import FSDPTrainer
    from nodes.trainer.weights import PushConfig, WeightPusher
    from tests.helpers.synthetic import synthetic_batch, with_advantages

    trainer = FSDPTrainer(TrainConfig(model_path=model, lr=1e-3, max_tokens_per_mb=64))
    batch = synthetic_batch(2, 2, seed=1, prompt_len=(3, 6), gen_len=(3, 8))
    trainer.train_step(with_advantages(batch))
    # small buckets: several per push; no pause (the stand-in server runs no requests)
    cfg = PushConfig(bucket_bytes=64 << 10, pause_mode=None)
    pusher = WeightPusher(trainer.model, cfg, model_config_dir=model)
    pusher.connect([url])
    for kind, method, flat in (
        ("flat", "distributed", True),
        ("per-tensor", "distributed", False),
        ("tensor", "tensor", True),
    ):
        cfg.method, cfg.flattened_bucket = method, flat
        pusher.push(trainer.version)
        sd = trainer.full_state_dict()  # collective
        if dist.get_rank() == 0:
            httpx.post(url + "/dump", json={}, timeout=60).raise_for_status()
            (out / "received.safetensors").rename(out / f"received-{kind}.safetensors")
            save_file({k: v.contiguous() for k, v in sd.items()}, str(out / f"trainer-{kind}.safetensors"))
    pusher.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
