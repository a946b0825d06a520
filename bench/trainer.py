"""Trainer benchmarks, each against a baseline measured in the same run.

1. Balance: FFD token imbalance (max/mean tokens per rank) vs round-robin on skewed lengths.
2. Training throughput: tokens/s of a GRPO step on 2 CPU ranks (FSDP2 over gloo).
3. Weight push: full-model push from 2 FSDP ranks into a reference server (gather + HTTP +
   broadcast + load into the live model) vs a raw gloo broadcast of the same bytes between two
   processes that do nothing else. Variants side by side: the default (flattened buckets, rank
   1's shards through /dev/shm), shards by point-to-point sends instead, 256 MiB buckets (the
   next bucket's gather overlaps a broadcast), and one broadcast per tensor.

    python bench/trainer.py                 # all three, SmolLM2-135M
    python bench/trainer.py --only balance  # the pure-python part (seconds)
    python bench/trainer.py --only push     # the weight push alone (no training steps)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.helpers (the repository's, not installed)


# ---- 1. balance --------------------------------------------------------------------------------
def bench_balance() -> list[dict]:
    from nodes.trainer.balance import imbalance, round_robin, split_across_ranks
    from tests.helpers.synthetic import skewed_lengths

    rows = []
    for sigma in (0.5, 1.0, 1.5):
        for n_ranks in (2, 4, 8):
            ffd, rr = [], []
            for seed in range(20):
                rng = random.Random(seed)
                n_groups, group_size = 64, 8
                lengths = skewed_lengths(n_groups * group_size, rng, median=300, sigma=sigma, hi=8192)
                prompts = [rng.randint(50, 300) for _ in range(n_groups)]
                sizes = [
                    sum(prompts[g] + lengths[g * group_size + i] for i in range(group_size))
                    for g in range(n_groups)
                ]
                loads = lambda bins, s=sizes: [sum(s[i] for i in b) for b in bins]  # noqa: E731
                ffd.append(imbalance(loads(split_across_ranks(sizes, n_ranks))))
                rr.append(imbalance(loads(round_robin(sizes, n_ranks))))
            rows.append(
                {
                    "sigma": sigma,
                    "ranks": n_ranks,
                    "ffd_mean": sum(ffd) / len(ffd),
                    "ffd_max": max(ffd),
                    "rr_mean": sum(rr) / len(rr),
                    "rr_max": max(rr),
                }
            )
    return rows


# ---- 2 + 3: ranks ------------------------------------------------------------------------------
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(model: str, url: str, out: str, push_reps: int, train: bool) -> None:
    """One trainer rank: two train steps (the second timed), then rounds of pushes, each round
    preceded by the raw baseline so both see the same machine."""
    import torch
    import torch.distributed as dist

    from nodes.trainer.config import TrainConfig
    from nodes.trainer.fsdp import FSDPTrainer
    from nodes.trainer.gather import ParamGatherer
    from nodes.trainer.weights import PushConfig, WeightPusher
    from tests.helpers.synthetic import synthetic_batch, with_advantages

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    trainer = FSDPTrainer(TrainConfig(model_path=model, lr=1e-6, max_tokens_per_mb=1024))
    result: dict = {}
    if train:
        batch = synthetic_batch(4, 2, seed=0, vocab=32000, prompt_len=(60, 80), gen_len=(40, 120))
        trainer.train_step(with_advantages(batch))  # warm-up
        batch = synthetic_batch(4, 2, seed=1, vocab=32000, prompt_len=(60, 80), gen_len=(40, 120))
        stats = trainer.train_step(with_advantages(batch))
        result["train"] = {k: stats[k] for k in ("tokens_per_s", "n_tokens", "step_time_s", "prox_time_s")}

    bucket = int(os.environ.get("RLACTORS_BENCH_BUCKET_MIB", "1024")) << 20
    pusher = WeightPusher(trainer.model, PushConfig(bucket_bytes=bucket, pause_mode="retract"), model)
    gatherers = {
        "shm": ParamGatherer(trainer.model, bucket),
        "p2p": ParamGatherer(trainer.model, bucket, shared_memory=False),
        "small": ParamGatherer(trainer.model, 256 << 20),  # the next gather overlaps a broadcast
    }
    pusher.gatherer = gatherers["shm"]
    assert pusher.gatherer.shared_ranks, "rank 1 did not map rank 0's shared buffers"
    pusher.connect([url])
    nbytes = sum(s.nbytes for s in pusher.gatherer.specs)
    if rank == 0:  # the raw baseline: the same bytes from a process that holds them to one that only receives
        port = free_port()
        recv = subprocess.Popen(
            [sys.executable, __file__, "_recv", str(port), str(nbytes), str(push_reps)],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        timeout = datetime.timedelta(seconds=120)
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timeout)
        raw_pg = dist.ProcessGroupGloo(dist.PrefixStore("raw", store), 0, 2, timeout)
        flat = torch.randn(nbytes // 4)
        result["raw_broadcast_s"] = []
    # (key, flattened buckets, gatherer): the default first, then its variants
    variants = (
        ("push", True, "shm"),
        ("push_p2p", True, "p2p"),
        ("push_small_buckets", True, "small"),
        ("push_per_tensor", False, "shm"),
    )
    for key, _, _ in variants:
        result[key] = {"times_s": [], "parts": [], "bytes": nbytes}
    for _ in range(push_reps):
        if rank == 0:
            raw_pg.barrier().wait()
            t0 = time.perf_counter()
            raw_pg.broadcast(flat, 0).wait()
            raw_pg.barrier().wait()  # the receiver has it
            result["raw_broadcast_s"].append(time.perf_counter() - t0)
        dist.barrier()  # the default gather alone, no broadcast: what a push adds to the raw bytes
        t0 = time.perf_counter()
        for k in range(len(gatherers["shm"].buckets)):
            gatherers["shm"].gather(k)
        result.setdefault("gather_alone_s", []).append(time.perf_counter() - t0)
        for key, flattened, gatherer in variants:
            pusher.cfg.flattened_bucket, pusher.gatherer = flattened, gatherers[gatherer]
            dist.barrier()
            t0 = time.perf_counter()
            s = pusher.push(trainer.version)
            result[key]["times_s"].append(time.perf_counter() - t0)
            result[key]["parts"].append(
                [s.get(k, 0.0) for k in ("gather_s", "wait_s", "pause_s", "transfer_s", "resume_s")]
            )
            assert rank != 0 or s["push_bytes"] == nbytes
    pusher.close()
    if rank == 0:
        recv.wait(timeout=60)
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def recv_main(port: int, nbytes: int, reps: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timeout)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("raw", store), 1, 2, timeout)
    buf = torch.empty(nbytes // 4)
    for _ in range(reps):
        pg.barrier().wait()
        pg.broadcast(buf, 0).wait()
        pg.barrier().wait()


def bench_ranks(model_name: str, push_reps: int, train: bool) -> dict:
    from nodes.inference.models import ensure_smollm2_checkpoint, ensure_tiny_checkpoint
    from tests.helpers.servers import reference_server

    model = str(ensure_smollm2_checkpoint() if model_name == "smollm2" else ensure_tiny_checkpoint())
    out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    args = ["--backend", "hf", "--model-path", model, "--dtype", "float32", "--num-threads", "1"]
    with reference_server(args, timeout_s=300) as url:
        port = free_port()
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "_rank", model, url, out, str(push_reps), str(int(train))],
                env={
                    **os.environ,
                    "RANK": str(r),
                    "WORLD_SIZE": "2",
                    "LOCAL_RANK": str(r),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    "OMP_NUM_THREADS": "1",
                    "PYTHONPATH": str(ROOT),
                },
            )
            for r in range(2)
        ]
        try:
            for p in procs:
                if p.wait(timeout=1200) != 0:
                    raise SystemExit(f"rank exited with {p.returncode}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    res = json.loads(Path(out).read_text())
    os.unlink(out)
    return res


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_rank":
        return rank_main(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6] == "1")
    if len(sys.argv) > 1 and sys.argv[1] == "_recv":
        return recv_main(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=["balance", "ranks", "push"], default=None)
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--push-reps", type=int, default=8)
    ap.add_argument(
        "--bucket-mib", type=int, default=1024, help="weight-push bucket size (PushConfig's default)"
    )
    a = ap.parse_args()
    os.environ["RLACTORS_BENCH_BUCKET_MIB"] = str(a.bucket_mib)
    if a.only in (None, "balance"):
        print("## FFD vs round-robin: max/mean tokens per rank (64 groups x 8, log-normal lengths, 20 seeds)")
        print(f"{'sigma':>6} {'ranks':>5} {'FFD mean':>9} {'FFD max':>8} {'RR mean':>8} {'RR max':>7}")
        for r in bench_balance():
            print(
                f"{r['sigma']:>6} {r['ranks']:>5} {r['ffd_mean']:>9.4f} {r['ffd_max']:>8.4f} "
                f"{r['rr_mean']:>8.3f} {r['rr_max']:>7.3f}"
            )
    if a.only in (None, "ranks", "push"):
        res = bench_ranks(a.model, a.push_reps, train=a.only != "push")
        if "train" in res:
            t = res["train"]
            print(
                f"## training, 2 CPU ranks ({a.model}, fp32): {t['tokens_per_s']:.1f} tokens/s "
                f"({t['n_tokens']:.0f} tokens, step {t['step_time_s']:.2f} s incl. proximal recompute "
                f"{t['prox_time_s']:.2f} s)"
            )
        raw = res["raw_broadcast_s"]
        fmt = lambda xs: ", ".join(f"{x:.3f}" for x in xs)  # noqa: E731
        print(
            f"## weight push ({res['push']['bytes'] / 2**20:.0f} MiB, {a.bucket_mib} MiB buckets), 2 FSDP ranks -> "
            f"reference server, pause retract + session; {len(raw)} rounds, each: raw broadcast, then every variant"
        )
        print(
            f"   {'raw gloo broadcast':>19}: best {min(raw):.3f} s, median {median(raw):.3f} s; all: {fmt(raw)}"
        )
        alone = res["gather_alone_s"]
        print(
            f"   {'gather alone (shm)':>19}: best {min(alone):.3f} s, median {median(alone):.3f} s "
            f"(raw + gather, no overlap: {(min(raw) + min(alone)) / min(raw):.2f}x best, "
            f"{(median(raw) + median(alone)) / median(raw):.2f}x median)"
        )
        for key, label in (
            ("push", "default"),
            ("push_p2p", "shards by p2p sends"),
            ("push_small_buckets", "256 MiB buckets"),
            ("push_per_tensor", "per-tensor"),
        ):
            times = res[key]["times_s"]
            best = min(range(len(times)), key=times.__getitem__)
            g, w, pause, transfer, resume = res[key]["parts"][best]
            print(
                f"   {label:>19}: best {times[best]:.3f} s = pause {pause:.3f} + transfer {transfer:.3f} "
                f"(gather {g:.3f}, waiting on broadcasts+server {w:.3f}) + resume {resume:.3f} s; "
                f"median {median(times):.3f} s; all: {fmt(times)}; ratio to raw: best {times[best] / min(raw):.2f}x, "
                f"median {median(times) / median(raw):.2f}x (target <= 1.3x)"
            )


if __name__ == "__main__":
    main()
