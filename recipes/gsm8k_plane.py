"""What the GSM8K GRPO loop starts from: the model checkpoint, the inference servers, the trainer's
and the workflows' configs as the run fills them in, and the batch with a diagnosis when none comes
(see gsm8k_grpo.py)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import rlactors
from nodes.rollout.workflows import WorkflowSpec
from nodes.trainer.config import TrainConfig
from recipes.gsm8k_config import ConfigError, ModelConfig, RecipeConfig


def resolve_model(cfg: ModelConfig) -> Path:
    from nodes.inference.models import ensure_smollm2_checkpoint, ensure_tiny_checkpoint

    if cfg.path:
        p = Path(cfg.path).expanduser()
        if not (p / "config.json").exists():
            raise FileNotFoundError(f"model.path={p} is not a Hugging Face model folder (no config.json)")
        return p
    if cfg.tiny:
        return ensure_tiny_checkpoint()
    return ensure_smollm2_checkpoint()


async def start_servers(
    cluster: rlactors.Cluster, cfg: RecipeConfig, model: Path, out: Path
) -> tuple[list[Any], list[str]]:
    """Spawn the inference servers and wait until each is healthy; each writes its log to
    ``<out>/servers/server-<i>.log`` on its host."""
    from nodes.inference.launcher import InferenceServerActor, ReferenceServerConfig, SGLangServerConfig

    s = cfg.servers
    server_cfg: ReferenceServerConfig | SGLangServerConfig
    if s.kind == "reference":
        server_cfg = ReferenceServerConfig(
            model_path=str(model),
            backend=s.backend,
            max_running_requests=s.max_running_requests,
            cache_tokens=s.cache_tokens,
            dtype=s.dtype,
            device=s.device,
            extra_args=s.extra_args,
        )
    else:  # real SGLang: on GPUs from this environment, on CPU from its own venv (servers.python)
        server_cfg = SGLangServerConfig(
            model_path=str(model),
            python=s.python,
            device="cuda" if s.gpus_per_server else "cpu",
            dtype=s.dtype,
            extra_args=["--max-running-requests", str(s.max_running_requests), *s.extra_args],
        )
    env = {"OMP_NUM_THREADS": str(s.threads)} if s.gpus_per_server == 0 else {}
    handles = [
        await cluster.spawn(
            InferenceServerActor,
            server_cfg,
            env=env,  # the worker's environment; the server process inherits it
            startup_timeout_s=s.startup_timeout_s,
            # A restarted server would come back with base weights, outside the weight-update
            # group: let a dead server stay dead; the loop drops it and rollout fails over.
            server_max_restarts=0,
            name=f"server-{i}",
            log_path=str(out / "servers" / f"server-{i}.log"),
            resources={"gpu": s.gpus_per_server},
        )
        for i in range(s.n)
    ]
    urls = list(await asyncio.gather(*(h.url() for h in handles)))
    return handles, urls


def train_config(cfg: RecipeConfig, model: Path, out: Path) -> TrainConfig:
    """``[trainer]`` with what the run decides: the model, the schedule's length, the seed, the
    sampling temperature for the loss, and where the disk push writes."""
    t = cfg.trainer
    return dataclasses.replace(
        t,
        model_path=str(model),
        total_steps=max(1, cfg.run.steps * t.n_minibatches),
        seed=cfg.run.seed,
        loss=dataclasses.replace(t.loss, temperature=cfg.rollout.temperature),
        push=dataclasses.replace(t.push, disk_dir=t.push.disk_dir or str(out / "weights")),
    )


def workflow_spec(cfg: RecipeConfig, model: Path, *, eval_mode: bool = False) -> WorkflowSpec:
    """What a rollout actor builds its workflow from; ``eval_mode``: one sample per prompt at the
    eval temperature with the single-turn workflow."""
    from nodes.data import PROMPT_SUFFIX
    from nodes.plugins import resolve

    r = cfg.rollout
    workflow = "nodes.rollout.workflows:RLVRWorkflow" if eval_mode else r.workflow
    settings = {
        "n_samples": 1 if eval_mode else r.n_samples,
        "system_prompt": cfg.data.system_prompt or None,
        "prompt_suffix": PROMPT_SUFFIX,
        "sampling_params": {
            "max_new_tokens": r.max_new_tokens,
            "temperature": cfg.run.eval_temperature if eval_mode else r.temperature,
        },
        **({} if eval_mode else r.workflow_args),
    }
    config_class = resolve(workflow, "rollout.workflow").config_class
    try:
        config = config_class(**settings)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"rollout.workflow_args: {e}") from e
    return WorkflowSpec(workflow=workflow, tokenizer=str(model), reward=cfg.reward, config=config)


async def get_batch(buffer: Any, rollouts: list[Any], size: int, version: int, timeout: float) -> Any:
    """The next batch; if none comes in time, say why (a rollout actor's dispatch may have failed)."""
    try:
        return await buffer.get_batch(size, version, timeout)
    except TimeoutError:
        failures = [
            s["failure"] for s in await asyncio.gather(*(r.stats() for r in rollouts)) if s.get("failure")
        ]
        why = f"rollout failed: {failures}" if failures else f"buffer: {await buffer.stats()}"
        raise RuntimeError(
            f"no batch of {size} groups within {timeout:.0f}s at version {version}; {why}"
        ) from None
