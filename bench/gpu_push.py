"""Weight push to a reference server on the trainer's own device, against raw baselines measured
in the same run.

NCCL refuses two ranks on one GPU, so a trainer and a server that share one meet over gloo, which
moves CUDA tensors through host memory (nodes/trainer/weights.py). This measures what that costs:

1. push: ``WeightPusher.push`` of a bf16 model into a live reference server (hf backend) on the same
   device: pause, flattened buckets announced and broadcast, loaded into the live model, resume.
1b. push by reference: the same with ``method = "tensor"`` (``/update_weights_from_tensor``: CUDA
   IPC handles to the trainer's bucket buffers; shared memory on CPU).
2. raw gloo: a gloo broadcast of the same bytes between two processes on that device, nothing else.
3. CUDA IPC (cuda only): the receiver opens the sender's buffer through a CUDA IPC handle
   (torch.multiprocessing) and copies it into its own: the floor of what 1b can reach.
4. with ``--lora``: the same model with LoRA adapters (``[trainer.lora]`` defaults: rank 16, all
   linear layers) pushed to a server started with ``--enable-lora``, both ways: ``merged`` (the
   merged full weights over the weight-update group) and ``adapter`` (the adapter alone as a PEFT
   folder, ``/load_lora_adapter``).

    python bench/gpu_push.py --device cuda --size 1.4b   # a GPU machine (see scripts/gpu-check.sh
                                                         # for installing the packages there)
    python bench/gpu_push.py --device cpu --size tiny    # the same steps on CPU (a smoke run)
    python bench/gpu_push.py --device cuda --size 1.4b --lora   # also LoRA: adapter against merged

Prints one JSON object: each row's seconds per push (median and all) and GB/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

SIZES = {  # LlamaForCausalLM with SmolLM2's vocabulary (its tokenizer is what the cache holds)
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
    ),
    # Qwen2.5-1.5B's layers
    "1.4b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
    ),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build(size: str, device: str, dst: Path) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from nodes.inference.models import ensure_smollm2_tokenizer

    config = LlamaConfig(
        vocab_size=49152,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        **SIZES[size],
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(dst))
    for f in ensure_smollm2_tokenizer().iterdir():
        if f.is_file() and not f.name.startswith("."):
            (dst / f.name).write_bytes(f.read_bytes())
    return model


def bench_push(
    model: Any, path: Path, device: str, reps: int, method: str, lora_push: str | None = None
) -> dict[str, Any]:
    """``reps`` pushes of ``model`` (after one warm-up) into a fresh reference server; ``lora_push``
    ("merged" or "adapter") for a LoRA model, whose server is started with ``--enable-lora``."""
    from nodes.inference.launcher import ReferenceServerConfig, ServerSupervisor
    from nodes.trainer.config import LoraConfig, PushConfig
    from nodes.trainer.weights import WeightPusher

    async def run() -> dict[str, Any]:
        cfg = ReferenceServerConfig(
            model_path=str(path),
            backend="hf",
            device=device,
            dtype="bfloat16",
            enable_lora=lora_push is not None,
        )
        sup = ServerSupervisor(cfg, host="127.0.0.1", startup_timeout_s=600)
        await sup.start()
        try:
            cfg = PushConfig(method=method, keys=sup.keys, disk_dir=str(path / "pushes"))
            lora = LoraConfig(enabled=True, push=lora_push) if lora_push else None
            pusher = WeightPusher(model, cfg, model_config_dir=str(path), lora=lora)
            await asyncio.to_thread(pusher.connect, [sup.url])
            runs = [await asyncio.to_thread(pusher.push, v) for v in range(1, reps + 2)][1:]  # 1st warms
            await asyncio.to_thread(pusher.close)
            group = method == "distributed" and lora_push != "adapter"  # an adapter push forms no group
            return {"backend": pusher.backend if group else None, "runs": runs}
        finally:
            await sup.stop()

    out = asyncio.run(run())
    times = [r["push_time_s"] for r in out["runs"]]
    nbytes = out["runs"][0]["push_bytes"]
    return {
        "group_backend": out["backend"],
        "bytes": nbytes,
        "median_s": median(times),
        "all_s": [round(t, 4) for t in times],
        "GB_per_s": nbytes / median(times) / 1e9,
        "transfer_median_s": median(r["transfer_s"] for r in out["runs"]),
    }


def _gloo_rank(rank: int, port: int, nbytes: int, device: str, reps: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        dist.broadcast(t, src=0)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    if rank == 1:
        out.put(times[1:])


def _ipc_receiver(q: Any, done: Any, nbytes: int, reps: int, out: Any) -> None:
    import torch

    own = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        shared = q.get()  # the sender's buffer, through a CUDA IPC handle
        own.copy_(shared)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        del shared
        done.put(True)
    out.put(times[1:])


def bench_baselines(nbytes: int, device: str, reps: int) -> dict[str, Any]:
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_gloo_rank, args=(r, port, nbytes, device, reps, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    gloo = out.get(timeout=600)
    for p in procs:
        p.join()
    rows = {
        "raw_gloo": {
            "median_s": median(gloo),
            "all_s": [round(t, 4) for t in gloo],
            "GB_per_s": nbytes / median(gloo) / 1e9,
        }
    }
    if device == "cuda":
        q, done = ctx.Queue(), ctx.Queue()
        recv = ctx.Process(target=_ipc_receiver, args=(q, done, nbytes, reps, out))
        recv.start()
        buf = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
        for _ in range(reps + 1):
            q.put(buf)
            done.get(timeout=600)
        ipc = out.get(timeout=600)
        recv.join()
        rows["cuda_ipc_copy"] = {
            "median_s": median(ipc),
            "all_s": [round(t, 4) for t in ipc],
            "GB_per_s": nbytes / median(ipc) / 1e9,
        }
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--size", choices=sorted(SIZES), default="1.4b")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="", help="also write the JSON here")
    ap.add_argument("--lora", action="store_true", help="also push a LoRA model: adapter against merged")
    args = ap.parse_args()
    import torch

    report: dict[str, Any] = {"device": args.device, "size": args.size, "torch": torch.__version__}
    if args.device == "cuda":
        report["gpu"] = torch.cuda.get_device_name(0)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        model = build(args.size, args.device, Path(tmp))
        report["params"] = sum(p.numel() for p in model.parameters())
        report["build_s"] = round(time.perf_counter() - t0, 1)
        print(
            f"[gpu_push] {report['params'] / 1e9:.2f} B parameters built in {report['build_s']} s",
            file=sys.stderr,
        )
        dev = torch.device(args.device, 0) if args.device == "cuda" else None
        if dev is not None:
            torch.cuda.set_device(dev)
        init = f"tcp://127.0.0.1:{free_port()}"
        backend = "nccl" if args.device == "cuda" else "gloo"
        torch.distributed.init_process_group(backend, init_method=init, rank=0, world_size=1, device_id=dev)
        for row, method in (("push", "distributed"), ("push_tensor", "tensor")):
            report[row] = bench_push(model, Path(tmp), args.device, args.reps, method)
            print(f"[gpu_push] {row}: {report[row]['median_s']:.3f} s", file=sys.stderr)
        if args.lora:
            from nodes.trainer.config import LoraConfig
            from nodes.trainer.lora import apply_lora

            lora_model = apply_lora(model, LoraConfig(enabled=True))
            torch.manual_seed(1)
            with torch.no_grad():  # B starts at zero (the adapter a no-op): give it weights to push
                for name, p in lora_model.named_parameters():
                    if ".lora_B." in name:
                        p.normal_(std=1e-3)
            for way in ("merged", "adapter"):
                row = f"lora_{way}"
                report[row] = bench_push(lora_model, Path(tmp), args.device, args.reps, "distributed", way)
                print(f"[gpu_push] {row}: {report[row]['median_s']:.3f} s", file=sys.stderr)
            model = lora_model.unload()  # the base model again, adapters dropped
        torch.distributed.destroy_process_group()
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()
        report.update(bench_baselines(int(report["push"]["bytes"]), args.device, args.reps))
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
