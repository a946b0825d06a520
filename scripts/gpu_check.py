"""The GPU check's steps, run by scripts/gpu-check.sh against an installed rlactors (not this tree).

1. fsdp: FSDP2 (``fully_shard`` per layer, bf16 parameters, fp32 reduction) on the tiny model,
   3 optimizer steps on random tokens; the loss must be finite and the weights must move.
2. push: the reference server (hf backend) on the same device, and a weight push from step 1's
   model over a weight-update group (gloo: NCCL refuses two ranks on one GPU, so the pusher picks
   gloo for a server that reports the trainer's GPU); the server's copy of a parameter must equal
   the trainer's, and its weight version must be the pushed one.
3. push-tensor: the same by reference, ``/update_weights_from_tensor`` (CUDA IPC handles on a GPU,
   shared memory on CPU).
4. recipe: the GSM8K recipe with recipes/configs/gpu_1x.toml's geometry (one trainer rank and one
   reference server on the same GPU, bf16, weights pushed by reference), with the tiny model, a few
   local GSM8K rows and short generations, ``--steps`` steps; every push must reach the server
   through ``/update_weights_from_tensor`` (its access log says so).

Each step's result, timing and details go to one JSON report (``--report``); the exit code is the
number of steps that failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROWS = [  # GSM8K-style rows for the recipe step (the answer after ####): 8 to train, 4 held out
    {
        "question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
        "answer": f"#### {a + b}",
    }
    for a, b in [
        (3, 4),
        (10, 5),
        (7, 8),
        (12, 30),
        (6, 6),
        (21, 9),
        (2, 40),
        (15, 15),
        (8, 1),
        (4, 13),
        (20, 22),
        (9, 9),
    ]
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def step_fsdp(device: str, state: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from nodes.inference.models import ensure_tiny_checkpoint
    from nodes.trainer.fsdp import _apply_fsdp  # the trainer's own FSDP2 wrapping

    backend = "nccl" if device == "cuda" else "gloo"
    dev = torch.device("cuda", 0) if device == "cuda" else None
    if dev is not None:
        torch.cuda.set_device(dev)
    init = f"tcp://127.0.0.1:{free_port()}"
    dist.init_process_group(backend, init_method=init, rank=0, world_size=1, device_id=dev)
    path = ensure_tiny_checkpoint(seed=0, tied=False)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.config.use_cache = False
    model = _apply_fsdp(model, init_device_mesh(device, (1,)), bf16=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = model.get_parameter("model.norm.weight").full_tensor().detach().clone()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 49152, (8, 128), generator=gen).to(device)
    losses, times = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    after = model.get_parameter("model.norm.weight").full_tensor().detach()
    assert all(x == x and abs(x) != float("inf") for x in losses), f"non-finite loss: {losses}"
    assert not torch.equal(before, after), "the weights did not move"
    state.update(model=model, path=path)
    return {
        "losses": losses,
        "step_s": times,
        "mixed_precision": "bf16 parameters, fp32 reduction",
        "backend": backend,
    }


def step_push(device: str, state: dict[str, Any], method: str) -> dict[str, Any]:
    if "model" not in state:
        raise RuntimeError("needs the fsdp step's model")
    return asyncio.run(_push(device, state["model"], state["path"], method))


async def _push(device: str, model: Any, path: Path, method: str) -> dict[str, Any]:
    import httpx

    from nodes.inference.launcher import ReferenceServerConfig, ServerSupervisor
    from nodes.trainer.config import PushConfig
    from nodes.trainer.weights import WeightPusher

    cfg = ReferenceServerConfig(model_path=str(path), backend="hf", device=device, dtype="float32", auth="on")
    sup = ServerSupervisor(cfg, host="127.0.0.1", startup_timeout_s=300)
    t0 = time.perf_counter()
    await sup.start()
    started = time.perf_counter() - t0
    try:  # the pusher's calls block: in a thread, while this loop supervises the server
        pusher = WeightPusher(model, PushConfig(method=method, keys=sup.keys), model_config_dir=str(path))
        t1 = time.perf_counter()
        await asyncio.to_thread(pusher.connect, [sup.url])
        connect_s = time.perf_counter() - t1
        stats = await asyncio.to_thread(pusher.push, 1)
        name = "model.norm.weight"
        ours = model.get_parameter(name).full_tensor().detach().float().cpu()
        async with httpx.AsyncClient(base_url=sup.url, timeout=60, auth=sup.keys) as c:
            theirs = (
                await c.post("/get_weights_by_name", json={"name": name, "truncate_size": 10_000})
            ).json()
            version = (await c.get("/model_info")).json()["weight_version"]
        assert [round(x, 6) for x in ours.tolist()] == [round(x, 6) for x in theirs], (
            "the server's copy differs"
        )
        assert str(version) == "1", f"weight version {version!r}, pushed 1"
        await asyncio.to_thread(pusher.close)
        backend = pusher.backend if method == "distributed" else None  # tensor: no group
        return {
            "method": method,
            "backend": backend,
            "server_start_s": started,
            "connect_s": connect_s,
            "push": {k: v for k, v in stats.items() if isinstance(v, int | float)},
        }
    finally:
        await sup.stop()


def step_recipe(device: str, steps: int, config: str, work: Path) -> dict[str, Any]:
    data = work / "gsm8k"
    data.mkdir(parents=True, exist_ok=True)
    for split, rows in (("train", ROWS[:8]), ("test", ROWS[8:])):  # disjoint: eval drops trained prompts
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = work / "run"
    # The config's geometry as it is (one rank, one server, its push); only the model, the data and
    # the sizes shrink, and on CPU the devices move.
    args = [
        "--config", config, "model.tiny=true", 'model.path=""', "data.source=local", f"data.path={data}",
        "data.eval_size=4", "servers.kind=reference", "servers.reference.auth=on",
        'servers.reference.extra_args=["--log-level", "info"]',  # its access log: which routes the push used
        "rollout.workflow_args.n_samples=2", "rollout.workflow_args.max_new_tokens=32", "async.batch_size=2",
        "metrics.tensorboard=false", f"run.steps={steps}", "run.checkpoint_every=0", f"run.out_dir={out}",
    ]  # fmt: skip
    if device == "cpu":
        args += ["trainer.device=cpu", "servers.gpus_per_server=0", "servers.reference.device=cpu"]
    # One GPU for both, as gpu_1x.toml's header says: the local cluster is told of two
    # (CUDA_VISIBLE_DEVICES=0,0), placement gives the trainer rank one and the server the other,
    # and both map to physical GPU 0.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0,0"} if device == "cuda" else None
    t0 = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-m", "recipes.gsm8k_grpo", *args],
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=work,
        env=env,
    )
    seconds = time.perf_counter() - t0
    (work / "recipe.log").write_text(run.stdout + run.stderr)
    if run.returncode != 0:
        raise RuntimeError(f"the recipe exited with {run.returncode}:\n{(run.stdout + run.stderr)[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), "a step is missing"
    assert all(r["servers/min_weight_version"] == r["step"] for r in rows), "a push did not land"
    routes = re.findall(r'"POST (\S+) HTTP/1.1" 200', (out / "servers" / "server-0.log").read_text())
    pushes = routes.count("/update_weights_from_tensor")
    assert pushes >= steps, f"{pushes} pushes by reference for {steps} steps"
    assert "/init_weights_update_group" not in routes, "a weight-update group was made: not a tensor push"
    return {
        "wall_s": seconds,
        "step_s": [r.get("time/step_s", r.get("time/train_s")) for r in rows],
        "push_s": [r.get("push/push_time_s") for r in rows],
        "tensor_pushes": pushes,
        "reward_mean": [r["reward/mean"] for r in rows],
        "log": str(work / "recipe.log"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument(
        "--config", required=True, help="the recipe's one-GPU config (recipes/configs/gpu_1x.toml)"
    )
    ap.add_argument("--work", required=True, help="a scratch folder")
    ap.add_argument("--report", required=True)
    args = ap.parse_args()
    import torch

    import nodes

    work, state = Path(args.work), {}
    report: dict[str, Any] = {
        "device": args.device,
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
        "python": platform.python_version(),
        "rlactors_from": str(Path(nodes.__file__).parent.parent),
        "steps": [],
    }
    plan = [
        ("fsdp", lambda: step_fsdp(args.device, state)),
        ("push", lambda: step_push(args.device, state, "distributed")),
        ("push-tensor", lambda: step_push(args.device, state, "tensor")),
        ("recipe", lambda: step_recipe(args.device, args.steps, args.config, work)),
    ]
    for name, run in plan:
        t0 = time.perf_counter()
        try:
            entry = {"name": name, "ok": True, "details": run()}
        except Exception as e:  # a failed check is recorded and the next one runs
            entry = {
                "name": name,
                "ok": False,
                "error": f"{type(e).__name__}: {e}",
                "trace": traceback.format_exc(),
            }
        entry["seconds"] = round(time.perf_counter() - t0, 2)
        report["steps"].append(entry)
        print(
            f"[gpu-check] {name}: {'ok' if entry['ok'] else 'FAILED ' + entry['error'][:300]} ({entry['seconds']} s)",
            flush=True,
        )
    Path(args.report).write_text(json.dumps(report, indent=2, default=str))
    os.environ.pop("RANK", None)
    return sum(not s["ok"] for s in report["steps"])


if __name__ == "__main__":
    sys.exit(main())
