"""AReaL 1.0.4's rollout client, driven as its PPO trainer drives it (run with AReaL's own venv).

Started by bench/rollout.py, never imported by it: AReaL lives in a venv of its own, with its
requirements (bench/rollout.py's ``--areal`` names that venv's python). ``RemoteSGLangEngine(...).initialize(addr=[...])``,
then per step ``prepare_batch`` (its WorkflowExecutor, staleness manager and dispatcher) and the
trainer's weight-update sequence with no weights: ``pause`` -> ``pause_generation`` ->
``continue_generation`` -> ``set_version`` -> ``resume`` (areal/trainer/rl_trainer.py).

The workflow is AReaL's RLVRWorkflow episode shape (one ``agenerate`` per sample, the reward
through its ``AsyncRewardWrapper`` process pool, tensors out), grouped K times by
``prepare_batch(group_size=K)``, on the prompt ids bench/rollout.py wrote (its byte tokenizer's
chat ids, so both clients post the same requests).

Protocol on stdout: ``warm`` after the warm-up steps, then ``done {json}`` after the measured ones;
the parent measures this process tree's CPU between the two lines.

    V/bin/python bench/areal_client.py --spec spec.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import uuid
from typing import Any


def final_number_reward(
    prompt: str, completion: str, input_ids: Any, output_ids: Any, answer: str = "", **_: Any
) -> float:
    """1 if the completion's last number is the answer (AReaL's reward signature)."""
    nums = re.findall(r"-?\d+", completion)
    return float(bool(nums) and nums[-1] == answer)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", required=True, help="JSON: urls, prompts, K, max_new_tokens, B, eta, C, steps")
    spec = json.loads(open(ap.parse_args().spec).read())

    import torch
    from areal.api import AsyncRewardWrapper, ModelRequest, RolloutWorkflow
    from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig
    from areal.engine.sglang_remote import RemoteSGLangEngine
    from torchdata.stateful_dataloader import StatefulDataLoader

    class ByteWorkflow(RolloutWorkflow):
        """AReaL's RLVRWorkflow.arun_episode with a byte-level decode instead of an HF tokenizer."""

        def __init__(self, max_new_tokens: int) -> None:
            self.gconfig = GenerationHyperparameters(
                n_samples=1, max_new_tokens=max_new_tokens, temperature=1.0
            )
            self.reward = AsyncRewardWrapper(final_number_reward)

        async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, torch.Tensor]:
            req = ModelRequest(
                rid=uuid.uuid4().hex, input_ids=data["input_ids"], gconfig=self.gconfig.new(n_samples=1)
            )
            resp = await engine.agenerate(req)
            text = bytes(t for t in resp.output_tokens if t < 256).decode(errors="replace")
            reward = await self.reward("", text, resp.input_tokens, resp.output_tokens, answer=data["answer"])
            seq = resp.input_tokens + resp.output_tokens
            return {
                "input_ids": torch.tensor(seq, dtype=torch.int32)[None],
                "loss_mask": torch.tensor([0] * resp.input_len + [1] * resp.output_len, dtype=torch.int32)[
                    None
                ],
                "logprobs": torch.tensor([0.0] * resp.input_len + resp.output_logprobs, dtype=torch.float32)[
                    None
                ],
                "versions": torch.tensor([-1] * resp.input_len + resp.output_versions, dtype=torch.int32)[
                    None
                ],
                "attention_mask": torch.ones(len(seq), dtype=torch.bool)[None],
                "rewards": torch.tensor([reward], dtype=torch.float32),
            }

    B, K = spec["batch_size"], spec["n_samples"]
    cfg = InferenceEngineConfig(
        backend=f"sglang:d{len(spec['urls'])}",
        consumer_batch_size=B,
        max_head_offpolicyness=spec["max_staleness"],
        max_concurrent_rollouts=spec["max_concurrent"],
        request_timeout=3600,
        setup_timeout=120,
    )
    engine = RemoteSGLangEngine(cfg)
    engine.initialize(addr=[u.removeprefix("http://") for u in spec["urls"]], train_data_parallel_size=1)
    loader = StatefulDataLoader(
        spec["prompts"], batch_size=B, shuffle=True, collate_fn=lambda x: x, drop_last=True
    )
    workflow = ByteWorkflow(spec["max_new_tokens"])
    version, staleness, trajectories = 0, 0, 0

    def step() -> None:
        nonlocal version, staleness, trajectories
        batch = engine.prepare_batch(loader, workflow=workflow, group_size=K)
        for traj in batch:
            v = traj["versions"][traj["loss_mask"].bool()]
            if v.numel():
                staleness = max(staleness, version - int(v.min()))
            trajectories += traj["input_ids"].shape[0]
        if spec["pause_every"] and version % spec["pause_every"] == 0:
            engine.pause()  # the trainer's weight update, without weights
            engine.pause_generation()
            time.sleep(spec["push_s"])  # the weight push
            engine.continue_generation()
            engine.set_version(version + 1)
            engine.resume()
        else:
            engine.set_version(version + 1)
        version += 1

    for _ in range(spec["warmup_steps"]):
        step()
    print("warm", flush=True)
    t0, steps = time.monotonic(), 0
    while time.monotonic() - t0 < spec["seconds"]:
        step()
        steps += 1
    wall = time.monotonic() - t0
    print(
        "done "
        + json.dumps(
            {"wall_s": wall, "steps": steps, "staleness_max": staleness, "trajectories": trajectories}
        ),
        flush=True,
    )
    engine.destroy()
    sys.exit(0)


if __name__ == "__main__":
    main()
