"""A trainer rank for the multi-process tests: ``python dist_worker.py SCENARIO OUT_DIR MODEL``.

Run by tests/trainer/test_fsdp.py with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set, as the runtime
would. Writes what the test compares into OUT_DIR (rank 0 only for full tensors).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def train_config(model: str):
    from nodes.trainer.config import LossConfig, TrainConfig

    # small micro-batch cap: several micro-batches per rank; a loose cap so some tokens are masked
    return TrainConfig(
        model_path=model,
        lr=1e-3,
        adam_eps=1e-6,
        weight_decay=0.01,
        grad_clip=0.5,
        max_tokens_per_mb=40,
        loss=LossConfig(eps_clip=0.2, behav_imp_weight_cap=1.5),
    )


def train(trainer, b):
    """One step on ``b`` with GRPO advantages of its rewards."""
    from tests.helpers.synthetic import with_advantages

    return trainer.train_step(with_advantages(b))


def batch(seed: int, n_groups: int = 3):
    from tests.helpers.synthetic import synthetic_batch

    return synthetic_batch(n_groups, 2, seed=seed, prompt_len=(3, 6), gen_len=(3, 12), max_lag=1)


def save_full(trainer, path: Path) -> None:
    from safetensors.torch import save_file

    sd = trainer.full_state_dict()  # collective
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in sd.items()}, str(path))


PUSH_CASES = [  # (method, pause mode, flattened buckets)
    ("distributed", "abort", True),
    ("distributed", "retract", False),
    ("distributed", "in_place", True),
    ("tensor", "retract", True),  # by reference: rank 0's buckets through shared memory (CPU)
    ("disk", "retract", True),
]
LONG = {"max_new_tokens": 1000, "temperature": 0.0, "ignore_eos": True}


def server_weights(url: str, names: list[str]) -> dict[str, torch.Tensor]:
    import httpx

    out = {}
    with httpx.Client(timeout=60) as c:
        for n in names:
            r = c.post(url + "/get_weights_by_name", json={"name": n, "truncate_size": 1 << 30})
            r.raise_for_status()
            out[n] = torch.tensor(r.json(), dtype=torch.float32)
    return out


def wait_for_load(client, url: str, key: str, n: int, timeout_s: float = 60.0) -> None:
    """Poll the server's ``/v1/loads`` until ``key`` reaches ``n``."""
    import time

    deadline = time.monotonic() + timeout_s
    while (seen := client.get(url + "/v1/loads").json()["loads"][0][key]) < n:
        assert time.monotonic() < deadline, f"{key} stayed at {seen}, not {n}, for {timeout_s}s"
        time.sleep(0.005)


def attempted(seen: dict, key: str, fn, error: type[Exception]) -> float:
    """``fn()``; ``seen[key]``: None, or the message of the ``error`` it raised. Returns its seconds."""
    import time

    t0 = time.monotonic()
    try:
        fn()
        seen[key] = None
    except error as e:
        seen[key] = str(e)
    return time.monotonic() - t0


def push_scenario(trainer, model: str, out: Path, url: str) -> None:
    """Train, then push under each case with requests in flight; rank 0 records what it saw."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from nodes.trainer.weights import PushConfig, WeightPusher, WeightPushError

    rank = dist.get_rank()
    cfg = PushConfig(bucket_bytes=32 << 10, disk_dir=str(out / "pushed"))  # small: several buckets
    pusher = WeightPusher(trainer.model, cfg, model_config_dir=model)
    pusher.connect([url])
    pool = ThreadPoolExecutor(4)
    client = httpx.Client(timeout=120)
    results = []
    for i, (method, mode, flat) in enumerate(PUSH_CASES):
        train(trainer, batch(10 + i))
        cfg.method, cfg.pause_mode, cfg.flattened_bucket = method, mode, flat
        futs = []
        if rank == 0:
            # posted while the server is paused, so both start in the same step: posted to a running
            # server, one may finish before a loaded machine's second post arrives
            client.post(url + "/pause_generation", json={"mode": "in_place"}).raise_for_status()
            futs = [
                pool.submit(
                    client.post, url + "/generate", json={"input_ids": [5, 6, 7 + j], "sampling_params": LONG}
                )
                for j in range(2)
            ]
            wait_for_load(client, url, "num_waiting_reqs", 2)
            client.post(url + "/continue_generation", json={}).raise_for_status()
            wait_for_load(client, url, "num_running_reqs", 2)
        stats = pusher.push(trainer.version)
        full = trainer.full_state_dict()
        if rank == 0:
            info = client.get(url + "/get_model_info").json()
            gens = [f.result(timeout=120).json() for f in futs]
            names = [n for n in full if n != "lm_head.weight"]
            served = server_weights(url, names)
            results.append(
                {
                    "method": method,
                    "mode": mode,
                    "flattened": flat,
                    "version": trainer.version,
                    "push_bytes": stats["push_bytes"],
                    "server_version": info["weight_version"],
                    "equal": {n: bool(torch.equal(served[n], full[n])) for n in names},
                    "finish": [g["meta_info"]["finish_reason"]["type"] for g in gens],
                    "completion_tokens": [g["meta_info"]["completion_tokens"] for g in gens],
                    "gen_versions": [g["meta_info"]["weight_version"] for g in gens],
                }
            )
    # keep_paused: the server stays paused after the push, holding what is posted, until the
    # caller continues it (PolicySync re-posts held requests first)
    cfg.method, cfg.pause_mode = "distributed", "abort"
    train(trainer, batch(50))
    stats = pusher.push(trainer.version, keep_paused=True)
    if rank == 0:
        held = pool.submit(
            client.post, url + "/generate", json={"input_ids": [5, 6, 9], "sampling_params": LONG}
        )
        time.sleep(1.0)
        was_held = not held.done()
        client.post(url + "/continue_generation", json={}).raise_for_status()
        gen = held.result(timeout=120).json()
        keep = {"left_paused": stats["left_paused"], "held": was_held,
                "finish": gen["meta_info"]["finish_reason"]["type"],
                "gen_version": gen["meta_info"]["weight_version"], "version": trainer.version}  # fmt: skip
        (out / "push_keep.json").write_text(json.dumps(keep))
    dist.barrier()
    # a server that refuses the session (someone else's is open): every rank raises, the server is
    # left generating with that session still open, and once it is closed the next push goes through
    cfg.method = "distributed"
    if rank == 0:
        client.post(url + "/begin_weight_update", json={"selector": "all"}).raise_for_status()
    dist.barrier()
    try:
        pusher.push(trainer.version + 100)
        refused = ""
    except WeightPushError as e:
        refused = str(e)
    failure = {"rank": rank, "refused": refused}
    if rank == 0:
        gen = client.post(
            url + "/generate", json={"input_ids": [5, 6], "sampling_params": {**LONG, "max_new_tokens": 4}}
        )
        failure["after"] = gen.json()["meta_info"]["finish_reason"]["type"]
        failure["version_after_refusal"] = client.get(url + "/get_model_info").json()["weight_version"]
        failure["session_still_open"] = (
            client.post(url + "/begin_weight_update", json={"selector": "all"}).status_code == 400
        )
        client.post(url + "/end_weight_update", json={}).raise_for_status()
    dist.barrier()
    pusher.push(trainer.version + 101)
    if rank == 0:
        failure["version_after_retry"] = client.get(url + "/get_model_info").json()["weight_version"]
    (out / f"push_failure{rank}.json").write_text(json.dumps(failure))
    pusher.close()
    if rank == 0:
        (out / "push.json").write_text(json.dumps(results))


def refused_scenario(trainer, model: str, out: Path, urls: list[str]) -> None:
    """Servers that refuse their part of a collective with the trainer, each through a proxy of the
    test's (``urls``: one refusing ``/init_weights_update_group``, one refusing
    ``/update_weights_from_distributed``, the server itself): forming the group with the first, and
    pushing to the second (it never receives the broadcast: one bucket, the whole model, more than
    the sockets hold), fail at once naming the server, not after ``group_timeout_s``; then the
    server, asked directly, takes a push. Each rank records what it saw."""
    import httpx

    from nodes.trainer.weights import PushConfig, WeightPusher, WeightPushError

    refuses_join, refuses_update, direct = urls
    pusher = WeightPusher(trainer.model, PushConfig(group_timeout_s=300), model_config_dir=model)
    seen: dict = {}
    seen["connect_s"] = attempted(seen, "connect", lambda: pusher.connect([refuses_join]), WeightPushError)
    pusher.connect([refuses_update])
    seen["push_s"] = attempted(seen, "push", lambda: pusher.push(1), WeightPushError)
    pusher.connect([direct])
    pusher.push(2)
    if dist.get_rank() == 0:
        seen["version_after"] = httpx.get(direct + "/get_model_info", timeout=60).json()["weight_version"]
    pusher.close()
    (out / f"refused{dist.get_rank()}.json").write_text(json.dumps(seen))


def gather_scenario(trainer, out: Path) -> None:
    """Assemble full parameters on rank 0 through shared memory, through sends, and mixed; each
    rank records which ranks shared rank 0's buffers, rank 0 whether every tensor came out exact."""
    from nodes.trainer.gather import ParamGatherer

    rank, world = dist.get_rank(), dist.get_world_size()
    missing = str(out / "no-such-dir")
    cases = {  # name: (shared_memory on this rank, shm_dir, dtype)
        "shm": (True, "/dev/shm", None),
        "shm_tmpdir_bf16": (True, str(out / "shm"), torch.bfloat16),
        "rank1_refuses": (rank != 1, "/dev/shm", None),
        "no_shm_dir": (True, missing, None),
        "disabled": (False, "/dev/shm", None),
    }
    if world > 2:  # one rank sends while the others share: all must still meet at the barriers
        cases = {"shm": cases["shm"], "rank2_refuses": (rank != 2, "/dev/shm", None)}
    (out / "shm").mkdir(exist_ok=True)
    results = {}
    for name, (enabled, shm_dir, dtype) in cases.items():
        g = ParamGatherer(trainer.model, 32 << 10, dtype, shared_memory=enabled, shm_dir=shm_dir)
        leftover = sorted(os.listdir(out / "shm"))
        equal = []
        for step in range(2):  # the second pass reuses the buffers after the weights changed
            if step:
                train(trainer, batch(20))
            got = {}
            for k in range(len(g.buckets)):
                got.update({n: t.clone() for n, t in g.gather(k)})  # views live until k + 2
            full = trainer.full_state_dict()
            if rank == 0:
                want = {n: (t.to(dtype) if dtype else t) for n, t in full.items()}
                names = sorted(want) if "lm_head.weight" in got else sorted(set(want) - {"lm_head.weight"})
                equal.append(sorted(got) == names and all(torch.equal(got[n], want[n]) for n in names))
        results[name] = {
            "shared_ranks": sorted(g.shared_ranks),
            "buckets": len(g.buckets),
            "equal": equal,
            "leftover_files": leftover,
        }
    results["mixed_dtypes"] = mixed_dtype_gather()
    (out / f"gather{rank}.json").write_text(json.dumps(results))


def mixed_dtype_gather() -> dict:
    """A bf16 layer then an fp32 norm: two buckets of two dtypes, the first 90 bytes long, so
    the second shared buffer must start aligned for fp32."""
    from torch.distributed.fsdp import fully_shard

    from nodes.trainer.gather import ParamGatherer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(15, 3, bias=False).to(torch.bfloat16), torch.nn.LayerNorm(3))
    for m in (model[0], model[1], model):
        fully_shard(m)
    g = ParamGatherer(model, 1 << 20)
    got = {}
    for k in range(len(g.buckets)):
        got.update({n: t.clone() for n, t in g.gather(k)})
    want = {n: p.full_tensor() for n, p in model.named_parameters()}
    equal = dist.get_rank() != 0 or (
        sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
    )
    return {
        "shared_ranks": sorted(g.shared_ranks),
        "buckets": len(g.buckets),
        "equal": [equal],
        "leftover_files": [],
    }


def nonfinite_scenario(trainer, out: Path) -> None:
    """inf in rank 1's shard of an optimizer state: save refuses it, the next update spreads it to
    the weights, push refuses those, and the step after that stops on its non-finite loss."""
    from nodes.trainer import checkpoint
    from nodes.trainer.fsdp import NonFiniteError
    from nodes.trainer.rank import TrainerRank

    rank = dist.get_rank()
    seen: dict = {}

    def attempt(key: str, fn) -> None:
        attempted(seen, key, fn, NonFiniteError)

    train(trainer, batch(1))
    embed = trainer.model.get_input_embeddings().weight
    if rank == 1:
        with torch.no_grad():
            trainer.optimizer.state[embed]["exp_avg"].to_local().view(-1)[0] = float("inf")
    attempt("save", lambda: checkpoint.save(trainer, out / "bad_ckpt"))
    train(trainer, batch(2))  # finite loss and gradients; the update makes the weights inf
    seen["weights_after_update"] = trainer.nonfinite()

    class Pusher:  # stands in for WeightPusher: records whether anything was sent
        cfg = type("Cfg", (), {"pause_mode": "retract", "method": "distributed"})()
        pushed = False

        def push(self, version: int) -> dict:
            Pusher.pushed = True
            return {}

    actor = TrainerRank()
    actor.trainer, actor.pusher = trainer, Pusher()
    attempt("push", actor.push_weights)
    seen["pushed"] = Pusher.pushed
    version = trainer.version
    attempt("step", lambda: train(trainer, batch(3)))
    seen["version_unchanged"] = trainer.version == version
    (out / f"nonfinite_{rank}.json").write_text(json.dumps(seen))


def diskfull_scenario(trainer, out: Path) -> None:
    """A checkpoint that does not fit: refused by its estimate before writing, then ENOSPC in rank
    1's DCP writer, then in rank 0's own trainer_state.json. Each time every rank raises
    DiskFullError, no partial folder is left, and step-1 (saved before) still loads."""
    import errno
    import pathlib

    import torch.distributed.checkpoint.filesystem as dcp_fs

    from nodes.common.disk import DiskFullError
    from nodes.trainer import checkpoint
    from nodes.trainer.manifest import STATE_FILE, verify

    rank = dist.get_rank()
    seen: dict = {}
    train(trainer, batch(1))
    checkpoint.save(trainer, out / "step-1", data_position=1)
    full = OSError(errno.ENOSPC, "No space left on device")

    def attempt(key: str) -> None:
        attempted(seen, key, lambda: checkpoint.save(trainer, out / "step-2", data_position=2), DiskFullError)
        dist.barrier()
        seen[f"{key}_left"] = sorted(p.name for p in out.iterdir())

    real_free = checkpoint.free_bytes
    checkpoint.free_bytes = lambda folder: 4096
    attempt("estimate")
    checkpoint.free_bytes = real_free

    real_write_item = dcp_fs._write_item

    def write_item_full(*a, **kw):
        raise full

    if rank == 1:
        dcp_fs._write_item = write_item_full
    attempt("dcp_rank1")
    dcp_fs._write_item = real_write_item

    real_write_text = pathlib.Path.write_text

    def write_text_full(self, *a, **kw):
        if self.name == STATE_FILE:
            raise full
        return real_write_text(self, *a, **kw)

    if rank == 0:
        pathlib.Path.write_text = write_text_full
    attempt("state_rank0")
    pathlib.Path.write_text = real_write_text

    verify(out / "step-1", (rank, 2))  # the checkpoint before is intact
    seen["resumed_version"] = checkpoint.load(trainer, out / "step-1").version
    (out / f"diskfull_{rank}.json").write_text(json.dumps(seen))


AGG_CASES = {  # name: LossConfig keywords (the last: sequence-level corrections, row-local)
    "token-mean": {},
    "seq-mean-token-mean": {"agg": "seq-mean-token-mean"},
    "seq-mean-token-sum": {"agg": "seq-mean-token-sum", "agg_norm": 12.0},
    "gspo+geo+tis": {"agg": "seq-mean-token-mean", "behav_imp_weight_cap": None},
}


def aggregation_scenario(model: str, out: Path, tag: str, max_tokens_per_mb: int) -> None:
    """One step per aggregation mode without clipping; rank 0 saves the gradient and the loss."""
    import dataclasses

    from safetensors.torch import save_file

    from nodes.trainer.config import LossConfig, MismatchCorrections
    from nodes.trainer.fsdp import FSDPTrainer

    losses = {}
    for name, kw in AGG_CASES.items():
        corr = MismatchCorrections()
        if name == "gspo+geo+tis":
            corr = MismatchCorrections(seq_ratio=True, geo_low=0.5, geo_high=2.0, tis_cap=1.5)
        loss = LossConfig(**{"eps_clip": 0.2, "behav_imp_weight_cap": 1.5, **kw}, fn_args=corr)
        cfg = dataclasses.replace(
            train_config(model), grad_clip=0.0, max_tokens_per_mb=max_tokens_per_mb, loss=loss
        )
        trainer = FSDPTrainer(cfg)
        stats = train(trainer, batch(1, n_groups=4))
        grads = {n: p.grad.full_tensor() for n, p in trainer.model.named_parameters()}
        losses[name] = {"loss": stats["loss"], "n_microbatches": stats["n_microbatches"]}
        if dist.get_rank() == 0:
            save_file(
                {k: v.contiguous() for k, v in grads.items()}, str(out / f"grad_{tag}_{name}.safetensors")
            )
    if dist.get_rank() == 0:
        (out / f"agg_{tag}.json").write_text(json.dumps(losses))


def run_scenario(scenario: str, out: Path, model: str, args: list[str]) -> None:
    """One scenario on this rank (the process group is up); ``args``: the scenario's own."""
    from nodes.trainer import checkpoint
    from nodes.trainer.fsdp import FSDPTrainer

    rank = dist.get_rank()
    if scenario == "aggregation":  # builds its own trainers
        aggregation_scenario(model, out, args[0], int(args[1]))
        return
    trainer = FSDPTrainer(train_config(model))
    if scenario == "fresh":
        stats = train(trainer, batch(1))
        if rank == 0:
            (out / "stats1.json").write_text(json.dumps(stats))
        save_full(trainer, out / "step1.safetensors")
        checkpoint.save(trainer, out / "ckpt", data_position=1)
        torch.rand(3)  # RNG advances after the checkpoint; resume must restore the saved state
        stats = train(trainer, batch(2, n_groups=1))  # one group on 2 ranks: rank 1 runs dummy micro-batches
        (out / f"stats2_{rank}.json").write_text(json.dumps(stats))
        save_full(trainer, out / "step2.safetensors")
    elif scenario == "schedule":  # one rank: warm-up and a KL term with the default reference
        import dataclasses

        from nodes.trainer.loss import LossConfig

        trainer = FSDPTrainer(
            dataclasses.replace(train_config(model), warmup_steps=3, loss=LossConfig(kl_coef=0.1))
        )
        steps = [train(trainer, batch(s)) for s in (1, 2)]
        (out / "schedule.json").write_text(json.dumps(steps))
    elif scenario == "resume":
        extra = checkpoint.load(trainer, out / "ckpt")
        if rank == 0:
            (out / "resume.json").write_text(
                json.dumps(
                    {
                        "data_position": extra.data_position,
                        "version": trainer.version,
                        "optim_steps": trainer.optim_steps,
                    }
                )
            )
        train(trainer, batch(2, n_groups=1))
        save_full(trainer, out / "step2_resumed.safetensors")
    elif scenario == "corrupt":  # OUT_DIR/ckpt had bytes changed after it was saved
        try:
            checkpoint.load(trainer, out / "ckpt")
        except checkpoint.CheckpointError as e:
            (out / f"load_error_{rank}.txt").write_text(str(e))
    elif scenario == "nonfinite":
        nonfinite_scenario(trainer, out)
    elif scenario == "gather":
        gather_scenario(trainer, out)
    elif scenario == "diskfull":
        diskfull_scenario(trainer, out)
    elif scenario == "push":
        push_scenario(trainer, model, out, args[0])
    elif scenario == "refused":
        refused_scenario(trainer, model, out, args)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")


def main() -> None:
    """``SCENARIO OUT_DIR MODEL [ARGS...]``, or ``--many MODEL JSON``: a JSON list of
    ``[scenario, out_dir, args]`` run one after the other in the same ranks (a rank's start-up,
    torch and the model, costs more than most scenarios)."""
    if sys.argv[1] == "--many":
        model, runs = sys.argv[2], json.loads(sys.argv[3])
    else:
        runs = [[sys.argv[1], sys.argv[2], sys.argv[4:]]]
        model = sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    for scenario, out, args in runs:
        run_scenario(scenario, Path(out), model, args)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
