"""One trainer rank of tests/trainer/test_lora_adapter.py's two-rank check: under FSDP2 every rank
gathers the adapter (``adapter_state``) as the tensors' own ``full_tensor()`` give it.

    python tests/trainer/lora_adapter_worker.py OUT_JSON MODEL   (RANK, WORLD_SIZE, MASTER_* set)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nodes.trainer.config import LoraConfig, TrainConfig  # noqa: E402
from nodes.trainer.fsdp import FSDPTrainer  # noqa: E402
from nodes.trainer.lora import adapter_state  # noqa: E402


def main(out: str, model: str) -> None:
    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    trainer = FSDPTrainer(TrainConfig(model_path=model, lora=LoraConfig(enabled=True, rank=4)))
    with torch.no_grad():  # distinct values on every rank's shard (a fresh B is all zeros)
        for n, p in trainer.model.named_parameters():
            if ".lora_" in n:
                local = p.to_local()
                local.copy_(torch.randn(local.shape, generator=torch.Generator().manual_seed(len(n) + rank)))
    state = adapter_state(trainer.model)
    want = {n: p.detach().full_tensor() for n, p in trainer.model.named_parameters() if ".lora_" in n}
    own = {
        k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): v
        for k, v in state.items()
    }
    result = {
        "names_in_order": list(own) == list(want),
        "equal": all(torch.equal(own[n], want[n]) for n in want),
        "rows_differ_by_rank": any(
            p.to_local().shape[0] < p.shape[0] for n, p in trainer.model.named_parameters() if ".lora_" in n
        ),
    }
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
