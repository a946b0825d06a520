"""LoRA vs full fine-tuning on the CPU default: step time and trainer memory.

The CPU recipe's trainer (SmolLM2-135M, 2 FSDP2 ranks over gloo, fp32, one thread each) runs a
warm-up step and then ``--steps`` timed GRPO steps on the same synthetic batches (4 groups x 2,
prompts 60-80, generations 40-120 tokens, as bench/trainer.py), once with full fine-tuning and once
with ``[trainer.lora]`` (rank 16, alpha 32, all linear layers: the defaults). Each mode runs in
fresh processes, so each rank's peak RSS is that mode's alone. Also measured: the trained
parameters, a checkpoint's size, and the push's gather of all buckets onto rank 0 (under LoRA it
merges the adapters on the way; no server).

With ``--pushes N`` (> 0) a reference server (hf backend, the same model, ``--enable-lora``) is
started and each mode pushes to it N times after training, as the recipe pushes: full fine-tuning
its weights (``trainer.push.method = "distributed"``, the default), LoRA both ways (``[trainer.lora]
push = "merged"``: merged full weights over the same group; ``"adapter"``: the adapter as a PEFT
folder, ``/load_lora_adapter``). Reported: the bytes each push sends and its time (rank 0's
``push_time_s``: pause, send, load, continue), median over the N pushes.

    nice -n 10 python bench/lora.py            # both modes, 3 timed steps each (~5-10 min on 2 cores)
    nice -n 10 python bench/lora.py --steps 1 --pushes 5   # push bytes and time: adapter vs merged
    python bench/lora.py --steps 1 --model tiny  # a quick check of the script
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.helpers (the repository's, not installed)


def rss_mib() -> float:
    """This process's peak resident set size so far (Linux: ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure_pushes(trainer: object, url: str, pushes: int, disk: str) -> dict[str, dict[str, float]]:
    """Push to the server at ``url`` ``pushes`` times each way the trainer's mode allows; per way,
    the median push time and the bytes (collective: every rank calls it)."""
    from nodes.trainer.config import LoraConfig, PushConfig
    from nodes.trainer.weights import WeightPusher

    lora = trainer.cfg.lora  # type: ignore[attr-defined]
    ways = {"merged": None}
    if lora.enabled:
        ways["adapter"] = LoraConfig(**{**lora.__dict__, "push": "adapter"})
    out = {}
    for way, cfg in ways.items():
        pusher = WeightPusher(trainer.model, PushConfig(disk_dir=disk), str(trainer.cfg.model_path), lora=cfg)  # type: ignore[attr-defined]
        pusher.connect([url])
        stats = [pusher.push(version) for version in range(1, pushes + 1)]
        pusher.close()
        out[way] = {
            "push_s_median": median(s["push_time_s"] for s in stats),
            "push_s_all": [s["push_time_s"] for s in stats],
            "push_bytes": stats[-1]["push_bytes"],
            # rank 0's phases (WeightPusher.push): until paused (an adapter push gathers and writes
            # the folder meanwhile), then sending and loading (the adapter: /load_lora_adapter)
            "pause_s_median": median(s["pause_s"] for s in stats),
            "transfer_s_median": median(s["transfer_s"] for s in stats),
        }
    return out


def rank_main(mode: str, model: str, out: str, steps: int, url: str = "", pushes: int = 0) -> None:
    import dataclasses

    import torch
    import torch.distributed as dist

    from nodes.trainer import checkpoint
    from nodes.trainer.config import LoraConfig, TrainConfig
    from nodes.trainer.fsdp import FSDPTrainer
    from nodes.trainer.gather import ParamGatherer
    from tests.helpers.synthetic import synthetic_batch, with_advantages

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    cfg = TrainConfig(model_path=model, lr=2e-5, max_tokens_per_mb=2048)  # recipes/configs/cpu.toml
    if mode == "lora":
        cfg = dataclasses.replace(cfg, lr=2e-4, lora=LoraConfig(enabled=True))
    rss0 = rss_mib()
    trainer = FSDPTrainer(cfg)
    rss_built = rss_mib()
    trained = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)  # full sizes
    times, tokens = [], []
    for s in range(steps + 1):  # step 0 warms up
        batch = synthetic_batch(4, 2, seed=s, vocab=32000, prompt_len=(60, 80), gen_len=(40, 120))
        dist.barrier()
        t0 = time.perf_counter()
        stats = trainer.train_step(with_advantages(batch))
        if s:
            times.append(time.perf_counter() - t0)
            tokens.append(stats["n_tokens"])
    rss_trained = rss_mib()
    g = ParamGatherer(trainer.model, 1 << 30)
    dist.barrier()
    t0 = time.perf_counter()
    for k in range(len(g.buckets)):
        g.gather(k)
    gather_s = time.perf_counter() - t0
    pushed = measure_pushes(trainer, url, pushes, f"{out}.weights") if pushes else {}
    ckpt = Path(out).with_suffix(".ckpt")
    checkpoint.save(trainer, ckpt)
    ckpt_mib = sum(f.stat().st_size for f in ckpt.iterdir()) / 2**20
    row = {
        "mode": mode,
        "rank": rank,
        "step_s": times,
        "tokens": tokens,
        "rss_start_mib": rss0,
        "rss_built_mib": rss_built,
        "rss_peak_mib": rss_trained,
        "trained_params": trained,
        "gather_s": gather_s,
        "checkpoint_mib": ckpt_mib,
        "pushes": pushed,
    }
    Path(f"{out}.rank{rank}").write_text(json.dumps(row))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(ckpt, ignore_errors=True)
    dist.destroy_process_group()


def run_mode(mode: str, model: str, steps: int, tmp: Path, url: str = "", pushes: int = 0) -> list[dict]:
    from tests.trainer.launch import run_ranks

    out = tmp / mode
    argv = ["_rank", mode, model, str(out), str(steps), url, str(pushes)]
    run_ranks(Path(__file__), argv, world=2, timeout=1800)
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]


def summary(rows: list[dict]) -> dict:
    step = [median(r["step_s"]) for r in rows]
    return {
        "step_s_median": max(step),  # the step ends when the slower rank does
        "step_s_all": rows[0]["step_s"],
        "tokens_per_s": median(rows[0]["tokens"]) / max(step),
        "rss_peak_mib_per_rank": [round(r["rss_peak_mib"]) for r in rows],
        "rss_built_mib_per_rank": [round(r["rss_built_mib"]) for r in rows],
        "trained_params": rows[0]["trained_params"],
        "gather_s": max(r["gather_s"] for r in rows),
        "checkpoint_mib": rows[0]["checkpoint_mib"],
        "pushes": rows[0]["pushes"],  # rank 0's: it talks to the server
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_rank":
        rank_main(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6], int(sys.argv[7]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per mode (after one warm-up)")
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--out", default="", help="write the results as JSON here")
    ap.add_argument("--pushes", type=int, default=0, help="pushes to a reference server per way (0: none)")
    ap.add_argument("--modes", default="full,lora", help="which modes to run, comma-separated")
    args = ap.parse_args()
    from nodes.inference.models import ensure_smollm2_checkpoint, ensure_tiny_checkpoint

    model = str(ensure_smollm2_checkpoint() if args.model == "smollm2" else ensure_tiny_checkpoint())
    results = {"model": args.model, "load_avg_before": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        url = ""
        if args.pushes:
            from tests.helpers.servers import reference_server

            flags = ["--model-path", model, "--device", "cpu", "--dtype", "float32", "--num-threads", "1"]
            url = stack.enter_context(reference_server([*flags, "--enable-lora"], timeout_s=600))
        for mode in args.modes.split(","):
            results[mode] = summary(run_mode(mode, model, args.steps, Path(tmp), url, args.pushes))
            print(mode, json.dumps(results[mode]), flush=True)
    results["load_avg_after"] = os.getloadavg()[0]
    for mode in args.modes.split(","):
        for way, p in results[mode]["pushes"].items():
            print(
                f"push, {mode} model, {way}: {p['push_bytes'] / 2**20:.1f} MiB in {p['push_s_median']:.2f} s "
                f"(median; paused after {p['pause_s_median']:.2f} s, sent and loaded in {p['transfer_s_median']:.2f} s)"
            )
    if "full" in results and "lora" in results:
        full, lora = results["full"], results["lora"]
        print(
            f"step time: full {full['step_s_median']:.1f} s, LoRA {lora['step_s_median']:.1f} s "
            f"({lora['step_s_median'] / full['step_s_median']:.2f}x); peak RSS per rank: full "
            f"{full['rss_peak_mib_per_rank']} MiB, LoRA {lora['rss_peak_mib_per_rank']} MiB; trained params: "
            f"full {full['trained_params']:,}, LoRA {lora['trained_params']:,}; checkpoint: full "
            f"{full['checkpoint_mib']:.1f} MiB, LoRA {lora['checkpoint_mib']:.1f} MiB; push gather: full "
            f"{full['gather_s']:.2f} s, LoRA {lora['gather_s']:.2f} s; load average "
            f"{results['load_avg_before']:.1f} -> {results['load_avg_after']:.1f}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
