"""A LoRA trainer rank for tests/trainer/test_lora.py: ``python lora_worker.py SCENARIO OUT_DIR MODEL``.

Run with RANK/WORLD_SIZE/MASTER_* set (tests/trainer/launch.py). Rank 0 writes what the test
compares into OUT_DIR.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from nodes.trainer.config import LoraConfig, LossConfig
from tests.trainer import dist_worker as worker

LORA = LoraConfig(enabled=True, rank=4, alpha=8.0, dropout=0.1)  # dropout: resume must restore its RNG


def train_config(model: str, **kw):
    # a KL term: its reference is the base model, the policy with its adapters off
    return dataclasses.replace(
        worker.train_config(model), lora=LORA, loss=LossConfig(eps_clip=0.2, kl_coef=0.05), **kw
    )


def params(trainer) -> dict[str, torch.Tensor]:
    """Every parameter of the trained (peft) model, full, by its peft name; collective."""
    return {n: p.full_tensor().clone() for n, p in trainer.model.named_parameters()}


def pushed(trainer, dtype=None) -> dict[str, torch.Tensor]:
    """What the distributed push sends: every bucket the gatherer assembles on rank 0; collective."""
    from nodes.trainer.gather import ParamGatherer

    g = ParamGatherer(trainer.model, 32 << 10, dtype)  # small buckets: several of them
    out: dict[str, torch.Tensor] = {}
    for k in range(len(g.buckets)):
        out.update({n: t.clone() for n, t in g.gather(k)})
    return out


def save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))


def ref_vs_base(trainer, model: str) -> float:
    """Largest difference between the trainer's reference log-probs and the base model's."""
    from transformers import AutoModelForCausalLM

    from nodes.trainer.loss import gather_logprobs_entropy
    from nodes.trainer.microbatch import build_microbatch

    b = worker.batch(7, n_groups=1)
    trajs = b.trajectories
    mb = build_microbatch(list(range(len(trajs))), trajs, [0.0] * len(trajs))
    trainer.model.eval()
    ref = trainer._ref_logp(mb)
    trainer.model.train()
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        logits = base(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[:, :-1]
        want, _ = gather_logprobs_entropy(logits, mb.labels, mb.temperature)
    return float((ref - want).abs().max())


def main() -> None:
    scenario, out, model = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    from nodes.trainer import checkpoint
    from nodes.trainer.fsdp import FSDPTrainer
    from nodes.trainer.weights import PushConfig, WeightPusher

    rank = dist.get_rank()
    trainer = FSDPTrainer(train_config(model))
    if scenario == "fresh":
        before = params(trainer)
        optimised = sorted(
            n
            for n, p in trainer.model.named_parameters()
            if any(p is q for q in trainer.optimizer.param_groups[0]["params"])
        )
        worker.train(trainer, worker.batch(1))
        after = params(trainer)
        save(before, out / "before.safetensors")
        save(after, out / "after.safetensors")
        sent = pushed(trainer)
        save(sent, out / "pushed.safetensors")
        save(pushed(trainer, torch.bfloat16), out / "pushed_bf16.safetensors")
        save(trainer.full_state_dict(), out / "full.safetensors")
        unchanged = all(torch.equal(after[n], t) for n, t in params(trainer).items())  # merging kept off it
        # the disk push (no servers: it writes the version folder, nothing to call)
        pusher = WeightPusher(
            trainer.model, PushConfig(method="disk", disk_dir=str(out / "disk"), pause_mode=None)
        )
        pusher.push(trainer.version)
        pusher.close()
        checkpoint.save(trainer, out / "ckpt", data_position=1)
        worker.train(trainer, worker.batch(2))
        save(trainer.full_state_dict(), out / "step2.safetensors")
        diff = ref_vs_base(trainer, model)
        if rank == 0:
            info = {
                "optimised": optimised,
                "unchanged_by_push": unchanged,
                "ref_model_loaded": trainer.ref_model is not None,
                "ref_vs_base": diff,
            }
            (out / "fresh.json").write_text(json.dumps(info))
    elif scenario == "resume":
        torch.rand(5)  # this RNG differs from the saved one: resume must restore it (dropout draws)
        state = checkpoint.load(trainer, out / "ckpt")
        worker.train(trainer, worker.batch(2))
        save(trainer.full_state_dict(), out / "step2_resumed.safetensors")
        if rank == 0:
            (out / "resume.json").write_text(
                json.dumps({"version": state.version, "data": state.data_position})
            )
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
