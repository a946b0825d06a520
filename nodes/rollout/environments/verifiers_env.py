"""Training ``verifiers`` environments unchanged (Prime Intellect's Environments Hub).

``[rollout] workflow = "nodes.rollout.environments:VerifiersWorkflow"`` with
``[rollout.workflow_args] env = "<module or Hub id>"`` and ``env_args = {...}``: the environment is
``verifiers.load_environment(env, **env_args)`` (a module path such as ``recipes.toy_envs.easy_sums``, or
the id of a Hub environment installed with pip, e.g. ``primeintellect/gsm8k`` -> module ``gsm8k``),
a ``vf.Environment`` (``SingleTurnEnv``, ``MultiTurnEnv``, ``ToolEnv``, ...) with its own dataset,
parser and rubric. ``[data] source = "env"`` trains on its dataset and evaluates on its eval dataset
(:func:`env_data`).

Each of an item's ``n_samples`` episodes is the environment's own ``rollout`` with a
``vf.OpenAIChatCompletionsClient`` on the episode's base_url (nodes/rollout/environments/episodes.py),
so its turns and tool calls are token-exact; the group is scored by the environment's rubric
(``score_group``, group reward functions included), the rubric's score is the reward, and each rubric
function's value and weight reach ``metrics.jsonl`` as ``episode/<name>`` and ``episode/<name>/weight``.
A rubric function that raises or returns NaN or a non-number (which verifiers itself would score 0)
drops the group, as an environment that raises does.

The classic ``load_environment`` -> ``vf.Environment`` API of verifiers 0.1-0.3 is supported (the
``envs`` extra pins verifiers 0.3.1, the newest with it; 0.4 keeps only ``verifiers.v1``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import logging
import math
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

from nodes.rollout.environments.episodes import (
    EnvEpisodes,
    EnvError,
    EpisodeSettings,
    finite_reward,
    sdk_client,
)
from nodes.rollout.reward import RewardRunner
from nodes.rollout.workflows import all_or_none
from protocols.rl import TrajectoryGroup
from protocols.runtime.codec import register

__all__ = ["VerifiersConfig", "VerifiersWorkflow", "env_data", "load_verifiers_env"]

INSTALL = "install the envs extra: pip install 'rlactors[envs]'"

# The rubric problems of the group being scored: a rubric function's wrapper adds to it
_bad_scores: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("bad_scores", default=None)


@register
@dataclass
class VerifiersConfig(EpisodeSettings):
    """A ``verifiers`` environment by module path or Hub id, its ``load_environment`` arguments,
    and how its episodes run."""

    # a module exporting load_environment(**kwargs) -> vf.Environment, or an installed Hub env's id
    env: str = ""
    env_args: dict[str, Any] = field(default_factory=dict)  # passed to load_environment
    # added to every request of the environment's (over its own sampling_args), e.g. tool_choice
    sampling_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.env:
            raise ValueError(
                "'env' must name a verifiers environment: a module exporting load_environment "
                "(e.g. recipes.toy_envs.easy_sums) or an installed Hub environment's id"
            )
        load_verifiers_env(self.env, self.env_args)  # a bad environment stops the run before it starts

    def env_data(self, data: Any) -> tuple[list[Any], list[Any], str, str]:
        """The items of ``[data] source = "env"`` (:func:`env_data`)."""
        return env_data(data, self)


_loaded: dict[str, Any] = {}


def load_verifiers_env(env: str, env_args: dict[str, Any]) -> Any:
    """``verifiers.load_environment(env, **env_args)``, once per process and arguments; a
    ``ValueError`` naming ``'env'`` (one line) when it cannot be loaded."""
    key = f"{env}:{sorted(env_args.items())!r}"
    if key in _loaded:
        return _loaded[key]
    try:
        import datasets
        import verifiers as vf

        load = vf.load_environment
    except ImportError as e:
        raise ValueError(f"'env' = {env!r}: verifiers is not installed ({e}); {INSTALL}") from None
    datasets.disable_progress_bars()  # environments map their datasets: one bar per process and split
    quiet = logging.getLogger("verifiers.legacy.utils.env_utils")  # its failure is our one line
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        loaded = load(env, **env_args)
    except Exception as e:  # a user's environment module may raise anything
        cause = e.__cause__ or e
        raise ValueError(
            f"'env' = {env!r}: load_environment failed: {type(cause).__name__}: {_line(cause)}"
        ) from None
    finally:
        quiet.setLevel(level)
    if not isinstance(loaded, vf.Environment):
        raise ValueError(
            f"'env' = {env!r}: load_environment returned {type(loaded).__name__}, not a vf.Environment"
        )
    _check_rubric(loaded.rubric)
    _loaded[key] = loaded
    return loaded


def _line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]


def _rubrics(rubric: Any) -> list[Any]:
    """``rubric`` and the rubrics inside it (a ``RubricGroup``'s, recursively)."""
    inner = getattr(rubric, "rubrics", None)
    return [rubric] if inner is None else [r for sub in inner for r in _rubrics(sub)]


def _check_rubric(rubric: Any) -> None:
    """Wrap every rubric function so that a raise or a value that is not a finite number is recorded
    for the group being scored (verifiers would log it and score 0): the group is dropped instead."""
    for r in _rubrics(rubric):
        r.funcs = [_checked(f) for f in r.funcs]


def _checked(func: Any) -> Any:
    if getattr(func, "_rlactors_checked", False):
        return func

    @functools.wraps(func)  # keeps the signature verifiers reads to pass arguments
    async def checked(*args: Any, **kwargs: Any) -> Any:
        bad = _bad_scores.get()
        try:
            value = func(*args, **kwargs)
            if inspect.isawaitable(value):
                value = await value
        except Exception as e:  # a user's rubric function: its failure is recorded
            if bad is not None:
                bad.append(f"rubric function {func.__name__} raised {type(e).__name__}: {_line(e)}")
            raise
        if bad is not None and not _numbers(value):
            bad.append(f"rubric function {func.__name__} returned {value!r}, not a finite number")
        return value

    checked._rlactors_checked = True  # type: ignore[attr-defined]
    return checked


def _numbers(value: Any) -> bool:
    values = value if isinstance(value, list) else [value]  # a group function returns a list
    return all(not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def _weights(rubric: Any) -> dict[str, float]:
    """Each rubric function's weight by name."""
    return {f.__name__: float(w) for r in _rubrics(rubric) for f, w in zip(r.funcs, r.weights, strict=True)}


class VerifiersWorkflow:
    """Runs a ``verifiers`` environment's rollout ``n_samples`` times per item through the rollout
    actor's endpoint; its rubric scores the group."""

    config_class: ClassVar[type] = VerifiersConfig

    def __init__(self, tokenizer: Any, reward: RewardRunner, config: VerifiersConfig | None = None) -> None:
        self.config = c = config or VerifiersConfig()
        self.env = load_verifiers_env(c.env, c.env_args)
        self.episodes = EnvEpisodes(tokenizer, c, c.env)
        self.counters = self.episodes.counters
        self.weights = _weights(self.env.rubric)

    async def arun_episode(self, client: Any, item: Any, group_id: str | None = None) -> TrajectoryGroup:
        """The environment's rollouts of ``item`` (one per sample), scored as a group by its rubric."""
        gid = group_id or uuid.uuid4().hex
        return await self.episodes.guard(self._group(client, item, gid), gid)

    async def _group(self, client: Any, item: Any, gid: str) -> TrajectoryGroup:
        async with contextlib.AsyncExitStack() as stack:
            opened = [
                await stack.enter_async_context(self.episodes.episode(client))
                for _ in range(self.config.n_samples)
            ]
            states = await all_or_none(self._rollout(url, item) for _, url in opened)
            bad: list[str] = []
            token = _bad_scores.set(bad)
            try:
                await self.env.rubric.score_group(states)
            finally:
                _bad_scores.reset(token)
            if bad:
                raise EnvError(f"environment {self.config.env}: {bad[0]}")
            trajs = []
            for (ep, _), state in zip(opened, states, strict=True):
                reward = finite_reward(state.get("reward"), f"environment {self.config.env}'s reward")
                trajs += self.episodes.trajectories(ep, reward, gid, self._info(state))
                await self.env.rubric.cleanup(state)
        if not trajs:
            raise EnvError(f"environment {self.config.env}: no completion in any episode of group {gid}")
        return TrajectoryGroup(gid, trajs)

    async def _rollout(self, url: str, item: dict[str, Any]) -> Any:
        import verifiers as vf

        sdk = sdk_client(url)
        try:
            sampling = {
                **{k: v for k, v in self.env.sampling_args.items() if k != "n"},
                **self.config.sampling_args,
            }
            if not sampling.get("extra_body"):
                sampling.pop("extra_body", None)
            state = await self.env.rollout(
                dict(item), vf.OpenAIChatCompletionsClient(sdk), self.config.model_name, sampling
            )
        finally:
            await sdk.close()
        if (err := state.get("error")) is not None:
            raise EnvError(
                f"environment {self.config.env}'s rollout failed: {type(err).__name__}: {_line(err)}"
            )
        return state

    def _info(self, state: Any) -> dict[str, float]:
        """Each rubric function's value and weight (``episode/<name>``, ``episode/<name>/weight``)."""
        info: dict[str, float] = {}
        for name, value in (state.get("metrics") or {}).items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                info[name] = float(value)
                info[f"{name}/weight"] = self.weights.get(name, 0.0)
        return info


def env_data(cfg: Any, settings: VerifiersConfig) -> tuple[list[Any], list[Any], str, str]:
    """``[data] source = "env"`` (``cfg`` is ``[data]``): the environment's dataset to train on and
    its eval dataset held out (the first ``data.eval_size`` rows); without one, ``data.eval_from_train``
    rows of its dataset (else a fifth of it, at most ``data.eval_size``), never trained on, as the
    about line says. Returns ``(train, held_out, about, held_out_about)``; ``ValueError`` (one line)."""
    import random

    env = load_verifiers_env(settings.env, settings.env_args)
    name = settings.env
    has_train = env.dataset_source is not None or env.dataset is not None
    train = _items(env.get_dataset() if has_train else [], name, "train")
    if env.eval_dataset_source is not None or env.eval_dataset is not None:
        held = _items(env.get_eval_dataset(), name, "eval")[: cfg.eval_size]
        held_about = f"{len(held)} rows of {name}'s eval dataset"
    else:
        n = cfg.eval_from_train or min(cfg.eval_size, len(train) // 5)
        order = list(range(len(train)))
        random.Random(cfg.seed).shuffle(order)
        out = set(order[:n])
        held = [t for i, t in enumerate(train) if i in out]
        train = [t for i, t in enumerate(train) if i not in out]
        held_about = (
            f"{len(held)} rows of {name}'s dataset held out, never trained on "
            "(it has no eval dataset; data.eval_from_train sets how many)"
        )
    if cfg.train_limit:
        train = train[: cfg.train_limit]
    if not train:
        raise ValueError(f"environment {name} has no training rows")
    return train, held, f"{len(train)} rows of environment {name}'s dataset", held_about


def _items(rows: Any, name: str, split: str) -> list[dict[str, Any]]:
    """Dataset rows as items: every column, plus ``id`` and ``question`` (the last user message)."""
    out = []
    for i, row in enumerate(rows):
        item = dict(row)
        item.setdefault("id", f"{name}-{split}-{i}")
        if "question" not in item:
            users = [m for m in item.get("prompt") or [] if isinstance(m, dict) and m.get("role") == "user"]
            item["question"] = str(users[-1].get("content", "")) if users else ""
        out.append(item)
    return out
