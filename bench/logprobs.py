"""The log-prob step's time and peak memory: ``gather_logprobs`` (no gradient: the proximal and
reference log-probs) against ``gather_logprobs_entropy`` with a backward (the policy's), each
against the baseline of the same tensors' ``torch.nn.functional.cross_entropy`` (PyTorch's own
fused log-softmax + gather), measured in the same run.

    python bench/logprobs.py --device cuda --tokens 1024 8192 32768
    python bench/logprobs.py --device cpu --tokens 1024

Peak memory is ``torch.cuda.max_memory_allocated`` above the logits on CUDA (not measured on CPU).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nodes.trainer.loss import gather_logprobs, gather_logprobs_entropy


def _measure(fn: Callable[[], object], device: str, reps: int) -> tuple[float, float | None]:
    times = []
    peak = None
    for i in range(reps + 1):
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        if i:  # the first is a warm-up
            times.append(time.perf_counter() - t0)
    return min(times) * 1e3, peak


def _rows(logits: torch.Tensor, labels: torch.Tensor) -> list[tuple[str, Callable[[], object]]]:
    def no_grad_logprobs() -> None:
        with torch.no_grad():
            gather_logprobs(logits, labels, 0.7)

    def no_grad_baseline() -> None:
        with torch.no_grad():
            torch.nn.functional.cross_entropy(logits.float() / 0.7, labels, reduction="none")

    def policy_step() -> None:
        x = logits.detach().requires_grad_()
        logp, ent = gather_logprobs_entropy(x, labels, 0.7)
        (logp.sum() + 0.01 * ent.sum()).backward()

    def policy_baseline() -> None:
        x = logits.detach().requires_grad_()
        torch.nn.functional.cross_entropy(x.float() / 0.7, labels, reduction="none").sum().backward()

    return [
        ("gather_logprobs, no grad", no_grad_logprobs),
        ("baseline: cross_entropy, no grad", no_grad_baseline),
        ("gather_logprobs_entropy + backward", policy_step),
        ("baseline: cross_entropy + backward (no entropy)", policy_baseline),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024])
    ap.add_argument("--vocab", type=int, default=49152)  # SmolLM2's
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    rows = []
    for n in args.tokens:
        g = torch.Generator(device=args.device).manual_seed(0)
        logits = torch.randn(n, args.vocab, device=args.device, dtype=dtype, generator=g)
        labels = torch.randint(0, args.vocab, (n,), device=args.device, generator=g)
        for name, fn in _rows(logits, labels):
            ms, peak = _measure(fn, args.device, args.reps)
            rows.append(
                {
                    "tokens": n,
                    "row": name,
                    "ms": round(ms, 2),
                    "peak_mib": None if peak is None else round(peak),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
        del logits, labels
    logits_mib = [round(n * args.vocab * dtype.itemsize / 2**20) for n in args.tokens]
    print(
        json.dumps(
            {
                "device": args.device,
                "dtype": args.dtype,
                "vocab": args.vocab,
                "logits_mib": logits_mib,
                "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
                "torch": torch.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
