"""Inference benchmarks for the reference server, each against a baseline measured in the same run.

1. ``hf`` backend, 8 concurrent greedy requests vs transformers ``generate`` at batch 8 on
   SmolLM2-135M (same prompts, same lengths, same thread count): tokens/s and their ratio.
2. A resumed request's prefix served from the prefix cache (abort mid-generation, re-post
   prompt + partial output): cached tokens / prefix tokens.
3. ``sim`` backend with 512 concurrent clients: sustained requests/s and tokens/s.

    python bench/inference.py            # full run, writes the "## Inference" section of bench/RESULTS.md
    python bench/inference.py --no-write --new-tokens 16 --sim-requests 512   # quicker look
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.helpers (the repository's, not installed)

from nodes.inference.models import ensure_smollm2_checkpoint  # noqa: E402
from tests.helpers.servers import reference_server  # noqa: E402

RESULTS = ROOT / "bench" / "RESULTS.md"


def make_prompts(n: int, length: int) -> list[list[int]]:
    """n distinct prompts of exactly ``length`` token ids (so generate needs no padding)."""
    return [[1] + [1000 + 97 * i + j for j in range(length - 1)] for i in range(n)]


def load_generate(ckpt: Path, prompts: list[list[int]], threads: int) -> Callable[[int], float]:
    """transformers generate at batch = len(prompts), greedy: returns ``run(new_tokens) -> tok/s``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)

    def run(new_tokens: int) -> float:
        with torch.inference_mode():
            t = time.perf_counter()
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
            )
            return len(prompts) * new_tokens / (time.perf_counter() - t)

    run(4)  # warm-up
    return run


async def server_once(url: str, prompts: list[list[int]], new_tokens: int) -> float:
    """Concurrent /generate calls, one per prompt, exactly new_tokens each, cache flushed: tok/s."""
    sp = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        assert (await c.post("/flush_cache")).status_code == 200  # prefill for real, as generate does
        t = time.perf_counter()
        rs = await asyncio.gather(
            *[c.post("/generate", json={"input_ids": p, "sampling_params": sp}) for p in prompts]
        )
        dt = time.perf_counter() - t
    assert all(len(r.json()["output_ids"]) == new_tokens for r in rs)
    return len(prompts) * new_tokens / dt


async def bench_resume(url: str, prompt_len: int, min_partial: int) -> tuple[int, int, float, float]:
    """Abort a running request after >= min_partial tokens, resume it; (prefix, cached, cold s, resumed s)."""
    prompt = [1] + [5000 + j for j in range(prompt_len - 1)]
    sp = {"max_new_tokens": 100000, "temperature": 0.0, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        await c.post("/flush_cache")
        task = asyncio.create_task(
            c.post("/generate", json={"input_ids": prompt, "rid": "bench-resume", "sampling_params": sp})
        )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            load = (await c.get("/v1/loads")).json()["loads"][0]
            if load["num_used_tokens"] >= prompt_len + min_partial:
                break
            await asyncio.sleep(0.05)
        await c.post("/abort_request", json={"rid": "bench-resume"})
        partial = (await task).json()["output_ids"]
        prefix = prompt + partial
        one = {"max_new_tokens": 1, "temperature": 0.0}
        t = time.perf_counter()
        r = (await c.post("/generate", json={"input_ids": prefix, "sampling_params": one})).json()
        resumed_s = time.perf_counter() - t
        await c.post("/flush_cache")
        t = time.perf_counter()
        await c.post("/generate", json={"input_ids": prefix, "sampling_params": one})
        cold_s = time.perf_counter() - t
    return len(prefix), r["meta_info"]["cached_tokens"], cold_s, resumed_s


async def _raw_client(host: str, port: int, left: list[int], i: int, new_tokens: int) -> int:
    """One keep-alive HTTP/1.1 connection posting /generate until the shared budget is spent.

    A raw client, because httpx's pool costs grow with the number of connections and at 512 it
    (not the server) becomes the bottleneck.
    """
    import json

    reader, writer = await asyncio.open_connection(host, port)
    body = json.dumps(
        {
            "input_ids": [1, 2, 3, 10 + i % 1000],
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True},
        }
    ).encode()
    req = (
        b"POST /generate HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    ) + body
    tokens = 0
    try:
        while left[0] > 0:
            left[0] -= 1
            writer.write(req)
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")
            )
            tokens += len(json.loads(await reader.readexactly(length))["output_ids"])
    finally:
        writer.close()
    return tokens


async def bench_sim(url: str, concurrency: int, total: int, new_tokens: int) -> tuple[float, float]:
    """``concurrency`` connections issuing ``total`` requests in all: (requests/s, tokens/s)."""
    host, port = url.split("//")[1].split(":")
    left = [total]
    t = time.perf_counter()
    tokens = sum(
        await asyncio.gather(*[_raw_client(host, int(port), left, i, new_tokens) for i in range(concurrency)])
    )
    dt = time.perf_counter() - t
    return total / dt, tokens / dt


def write_section(text: str) -> None:
    """Replace (or append) the "## Inference" section of bench/RESULTS.md."""
    old = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    start = old.find("## Inference")
    if start < 0:
        new = old.rstrip() + "\n\n" + text
    else:
        end = old.find("\n## ", start + 1)
        new = old[:start] + text.rstrip() + "\n\n" + (old[end + 1 :] if end >= 0 else "")
    RESULTS.write_text(new.rstrip() + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sim-concurrency", type=int, default=512)
    ap.add_argument("--sim-requests", type=int, default=4096)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()

    load_before = os.getloadavg()[0]
    ckpt = ensure_smollm2_checkpoint()
    prompts = make_prompts(args.batch, args.prompt_len)
    with reference_server(
        ["--backend", "hf", "--model-path", str(ckpt), "--num-threads", str(args.threads)], timeout_s=300
    ) as url:
        generate = load_generate(ckpt, prompts, args.threads)
        asyncio.run(server_once(url, prompts, 4))  # warm-up
        base = ours = 0.0
        for _ in range(args.reps):  # interleaved, so load from other processes hits both alike
            base = max(base, generate(args.new_tokens))
            ours = max(ours, asyncio.run(server_once(url, prompts, args.new_tokens)))
        print(f"transformers generate batch {args.batch}: {base:.1f} tok/s")
        print(f"reference server hf, {args.batch} concurrent: {ours:.1f} tok/s  ratio {ours / base:.2f}")
        prefix, cached, cold_s, resumed_s = asyncio.run(bench_resume(url, 256, 32))
        print(
            f"resume: {cached}/{prefix} prefix tokens from cache ({100 * cached / prefix:.1f}%), "
            f"first token {resumed_s * 1000:.0f} ms vs {cold_s * 1000:.0f} ms cold"
        )
    with reference_server(["--backend", "sim", "--max-running-requests", str(args.sim_concurrency)]) as url:
        rps, tps = asyncio.run(bench_sim(url, args.sim_concurrency, args.sim_requests, 32))
        print(f"sim, {args.sim_concurrency} concurrent clients: {rps:.0f} req/s, {tps:.0f} tok/s")

    if args.no_write:
        return
    machine = (
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, no GPU, "
        f"1-min load average {load_before:.1f} at start / {os.getloadavg()[0]:.1f} at end "
        "(absolute tok/s depend on what else runs; the ratios are measured side by side)"
    )
    write_section(
        "## Inference\n\n"
        f"Command: `python bench/inference.py` (threads={args.threads}, prompt {args.prompt_len} tokens, "
        f"{args.new_tokens} new tokens, greedy, best of {args.reps} interleaved runs). Machine: {machine}. "
        f"Date: {time.strftime('%Y-%m-%d')}.\n\n"
        "| what | baseline (same run) | ours | ratio / target |\n| --- | --- | --- | --- |\n"
        f"| `hf` backend, {args.batch} concurrent requests, SmolLM2-135M fp32 | transformers `generate` batch "
        f"{args.batch}: {base:.1f} tok/s | {ours:.1f} tok/s | {ours / base:.2f}x (target >= 0.8x) |\n"
        f"| resumed request's prefix from cache (256-token prompt, aborted mid-generation) | cold prefill "
        f"{cold_s * 1000:.0f} ms | {cached}/{prefix} tokens cached, {resumed_s * 1000:.0f} ms | "
        f"{100 * cached / prefix:.1f}% (target >= 95%) |\n"
        f"| `sim` backend, {args.sim_concurrency} concurrent clients, 32 new tokens, no latency model | - | "
        f"{rps:.0f} req/s, {tps:.0f} tok/s | - |\n"
    )
    print(f"wrote the Inference section of {RESULTS}")


if __name__ == "__main__":
    main()
