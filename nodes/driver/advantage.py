"""From rewards to advantages, on the driver between the batch and the trainer step: reward
shaping (:func:`shape_rewards`, ``[advantage.shaping]``), then an estimator over each group's shaped
rewards, one advantage per sequence out (GRPO puts one scalar on every token of a sequence).

The trajectories keep the reward the reward function gave (what evaluation and the metrics
report); shaping only changes what the estimator sees. The estimator is named by import path in
``[advantage] fn``; three ship here:

- :func:`grpo`: subtract the group mean, divide by the group std (GRPO, AReaL's default);
- :func:`dr_grpo`: subtract the group mean only (Dr. GRPO: no std division, no length bias);
- :func:`leave_one_out`: subtract the mean of the *other* samples of the group (RLOO).

An estimator is ``fn(rewards: list[list[float]], cfg: AdvantageConfig) -> list[list[float]]``, one
list per group, same shapes. ``batch_norm`` then normalises over all loss tokens of the batch. An
estimator may declare its settings class (``fn.config_class``, a dataclass): ``[advantage.fn_args]``
fills it and the estimator reads it as ``cfg.fn_args``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from nodes.common.plugins import NoSettings, function_settings, resolve
from protocols.runtime.codec import register
from rlactors.base.tomlconf import above, at_least, check_ranges, import_path

__all__ = [
    "AdvantageConfig",
    "ShapingConfig",
    "advantage_settings",
    "batch_advantages",
    "batch_normalize",
    "describe_shaping",
    "dr_grpo",
    "grpo",
    "leave_one_out",
    "overlong_penalty",
    "shape_rewards",
]

Groups = Sequence[Sequence[float]]


@register
@dataclass
class ShapingConfig:
    """Reward shaping before the estimator: ``clip((r + overlong(n) + bias) * scale, -clip, clip)``;
    by default the identity (a user's reward reaches the estimator as it is).

    ``overlong`` is DAPO's soft overlong punishment (Yu et al. 2025, "DAPO", sec. 3.4) on a
    trajectory's generated (loss) tokens ``n``, with ``L = overlong_max_len`` (the workflow's
    ``max_new_tokens``) and ``C = overlong_buffer``: 0 up to ``L - C``, then falling linearly to
    ``-overlong_penalty`` at ``L``, and ``-overlong_penalty`` past it. Added to the reward before
    bias and scale, as DAPO adds it to the rule-based reward. Off while ``overlong_max_len`` is 0.
    """

    # added to the reward; 0: the reward as the function gave it. AReaL's GSM8K values (the shipped
    # configs' [advantage.shaping]): bias -0.5, scale 10, clip 20, so a 1/0 reward becomes +5/-5
    bias: float = 0.0
    scale: float = 1.0  # the biased reward is multiplied by this
    clip: float = field(default=0.0, metadata=at_least(0))  # then clipped to [-clip, clip]; 0 = no clip
    overlong_max_len: int = field(default=0, metadata=at_least(0))  # L: the max new tokens; 0 = off
    overlong_buffer: int = field(default=0, metadata=at_least(0))  # C: the soft zone before L
    overlong_penalty: float = field(default=1.0, metadata=at_least(0))  # the penalty at and past L

    def __post_init__(self) -> None:
        check_ranges(self)
        if self.overlong_buffer > self.overlong_max_len:
            raise ValueError(
                f"'overlong_buffer' must be <= overlong_max_len ({self.overlong_max_len}), got {self.overlong_buffer}"
            )


def overlong_penalty(n_tokens: int, cfg: ShapingConfig) -> float:
    """DAPO's soft overlong punishment of a generation of ``n_tokens`` (0 when it is off)."""
    L, C = cfg.overlong_max_len, cfg.overlong_buffer
    if L == 0 or n_tokens <= L - C:
        return 0.0
    if n_tokens > L or C == 0:
        return -cfg.overlong_penalty
    return cfg.overlong_penalty * ((L - C) - n_tokens) / C


def advantage_settings(path: str) -> type:
    """The settings class of the estimator at import path ``path`` (its ``config_class``)."""
    return function_settings(path, "advantage.fn")


@register
@dataclass
class AdvantageConfig:
    # the estimator: grpo | dr_grpo | leave_one_out (this module), or yours
    fn: str = field(default="nodes.driver.advantage:grpo", metadata=import_path())
    batch_norm: bool = False  # then normalise over all loss tokens of the batch
    eps: float = field(default=1e-5, metadata=above(0))  # added to a std before dividing by it
    # reward shaping before the estimator: clip((reward + overlong + bias) * scale, -clip, clip); none by default
    shaping: ShapingConfig = field(default_factory=ShapingConfig)
    # the estimator's own settings (cfg.fn_args): an instance of its config_class, [advantage.fn_args]
    fn_args: Any = field(default_factory=NoSettings, metadata={"settings_of": ("fn", advantage_settings)})

    def __post_init__(self) -> None:
        check_ranges(self)


def shape_rewards(batch: Any, cfg: ShapingConfig) -> list[list[float]]:
    """Each group's rewards, shaped as ``cfg`` says (the estimator's input)."""
    bound = cfg.clip or math.inf
    return [
        [
            min(max((t.reward + overlong_penalty(t.loss_tokens, cfg) + cfg.bias) * cfg.scale, -bound), bound)
            for t in g.trajectories
        ]
        for g in batch.groups
    ]


def describe_shaping(cfg: ShapingConfig) -> str:
    """``cfg`` in a few words, for the run's first lines."""
    parts = []
    if cfg.bias or cfg.scale != 1.0 or cfg.clip:
        parts.append(
            f"(reward {cfg.bias:+g}) x {cfg.scale:g}" + (f", clipped to +-{cfg.clip:g}" if cfg.clip else "")
        )
    if cfg.overlong_max_len:
        parts.append(f"overlong penalty past {cfg.overlong_max_len - cfg.overlong_buffer} tokens")
    return "; ".join(parts) if parts else "none (the reward as the function gives it)"


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def dr_grpo(rewards: Groups, cfg: AdvantageConfig) -> list[list[float]]:
    """``r - mean(group)``. A lone sample has no baseline: advantage 0."""
    return [[x - _mean(g) for x in g] for g in rewards]


def grpo(rewards: Groups, cfg: AdvantageConfig) -> list[list[float]]:
    """``(r - mean(group)) / (std(group) + eps)``; a group of equal rewards gets 0."""
    out = []
    for g, adv in zip(rewards, dr_grpo(rewards, cfg), strict=True):
        m = _mean(g)
        std = math.sqrt(sum((x - m) ** 2 for x in g) / len(g))
        out.append([a / (std + cfg.eps) for a in adv])
    return out


def leave_one_out(rewards: Groups, cfg: AdvantageConfig) -> list[list[float]]:
    """``r - mean(other samples of the group)`` (RLOO); a lone sample gets 0."""
    n_total = [(len(g), sum(g)) for g in rewards]
    return [
        [x - (total - x) / (n - 1) if n > 1 else 0.0 for x in g]
        for g, (n, total) in zip(rewards, n_total, strict=True)
    ]


def batch_normalize(advantages: Sequence[float], n_tokens: Sequence[int], eps: float = 1e-5) -> list[float]:
    """Normalise per-sequence advantages to zero mean, unit std over all loss tokens of a batch
    (each sequence weighted by its count of loss tokens, as token-level normalisation would)."""
    total = sum(n_tokens)
    if total == 0:
        return list(advantages)
    mean = sum(a * n for a, n in zip(advantages, n_tokens, strict=True)) / total
    var = sum(n * (a - mean) ** 2 for a, n in zip(advantages, n_tokens, strict=True)) / total
    return [(a - mean) / (math.sqrt(var) + eps) for a in advantages]


def batch_advantages(batch: Any, rewards: Groups, cfg: AdvantageConfig) -> list[float]:
    """One advantage per trajectory of ``batch.trajectories`` from the groups' (shaped) rewards."""
    per_group = resolve(cfg.fn, "advantage.fn")(rewards, cfg)
    if [len(a) for a in per_group] != [len(g.trajectories) for g in batch.groups]:
        raise ValueError(f"advantage.fn={cfg.fn!r} returned groups of other sizes than the batch's")
    flat = [float(a) for g in per_group for a in g]
    if cfg.batch_norm:
        flat = batch_normalize(flat, [t.loss_tokens for t in batch.trajectories], cfg.eps)
    return flat
