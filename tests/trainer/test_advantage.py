"""Reward shaping and the shipped advantage estimators against hand-computed values; an estimator
named by import path is what the batch gets."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from nodes.driver.advantage import (
    AdvantageConfig,
    ShapingConfig,
    batch_advantages,
    batch_normalize,
    dr_grpo,
    grpo,
    leave_one_out,
    overlong_penalty,
    shape_rewards,
)
from tests.helpers.synthetic import synthetic_batch

CFG = AdvantageConfig()


def test_shaping_biases_scales_and_clips():
    batch = synthetic_batch(2, 2, seed=0)
    for g, rewards in zip(batch.groups, ([1.0, 0.0], [0.6, 0.5]), strict=True):
        for t, r in zip(g.trajectories, rewards, strict=True):
            t.reward = r
    cfg = ShapingConfig(bias=-0.5, scale=5.0, clip=2.0)
    assert shape_rewards(batch, cfg) == [[2.0, -2.0], [pytest.approx(0.5), 0.0]]
    assert shape_rewards(batch, ShapingConfig(bias=0.0, scale=1.0)) == [[1.0, 0.0], [0.6, 0.5]]
    assert [t.reward for t in batch.trajectories] == [1.0, 0.0, 0.6, 0.5]  # the batch keeps the raw rewards


def test_overlong_shaping_is_dapos_soft_penalty():
    """DAPO's soft overlong punishment with L = 10, C = 4: 0 up to 6 tokens, then -(n - 6) / 4, -1 past 10."""
    cfg = ShapingConfig(bias=0.0, scale=1.0, overlong_max_len=10, overlong_buffer=4)
    want = {1: 0.0, 6: 0.0, 7: -0.25, 8: -0.5, 9: -0.75, 10: -1.0, 11: -1.0, 40: -1.0}
    assert {n: overlong_penalty(n, cfg) for n in want} == pytest.approx(want)
    half = ShapingConfig(overlong_max_len=10, overlong_buffer=4, overlong_penalty=0.5)
    assert overlong_penalty(8, half) == pytest.approx(-0.25)
    assert overlong_penalty(10**6, ShapingConfig()) == 0.0  # off by default
    assert overlong_penalty(11, ShapingConfig(overlong_max_len=10)) == -1.0  # no buffer: a hard cliff
    assert overlong_penalty(10, ShapingConfig(overlong_max_len=10)) == 0.0
    # in shape_rewards: added to the reward before bias, scale and clip, by generated tokens
    batch = synthetic_batch(1, 3, seed=0, gen_lengths=[5, 8, 12])
    for t in batch.trajectories:
        t.reward = 1.0
    shaped = shape_rewards(
        batch, ShapingConfig(bias=-0.5, scale=10.0, clip=7.0, overlong_max_len=10, overlong_buffer=4)
    )
    assert shaped == [
        [5.0, pytest.approx(0.0), -5.0]
    ]  # (1 + 0 - .5) * 10; (1 - .5 - .5) * 10; (1 - 1 - .5) * 10
    with pytest.raises(ValueError, match="'overlong_buffer' must be <= overlong_max_len"):
        ShapingConfig(overlong_max_len=4, overlong_buffer=5)


def test_grpo_divides_by_the_group_std_and_a_constant_group_has_no_signal():
    adv = grpo([[2.5, -2.5, -2.5, 2.5], [1.0, 1.0]], CFG)
    assert adv[0] == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-4)
    assert adv[1] == [0.0, 0.0]
    assert grpo([[3.0]], CFG) == [[0.0]]


def test_dr_grpo_subtracts_the_mean_only():
    assert dr_grpo([[5.0, -5.0, -5.0, -5.0]], CFG)[0] == pytest.approx([7.5, -2.5, -2.5, -2.5])


def test_leave_one_out_uses_the_other_samples_mean():
    assert leave_one_out([[1.0, 0.0, 0.0]], CFG)[0] == pytest.approx([1.0, -0.5, -0.5])
    assert leave_one_out([[3.0]], CFG) == [[0.0]]


def test_batch_normalize_weights_by_tokens():
    out = batch_normalize([1.0, -1.0], [3, 1])
    # token-level: values [1,1,1,-1] -> mean 0.5, std sqrt(0.75)
    s = math.sqrt(0.75)
    assert out == pytest.approx([0.5 / s, -1.5 / s], rel=1e-4)
    assert sum(a * n for a, n in zip(out, [3, 1], strict=True)) == pytest.approx(0.0, abs=1e-9)


def test_batch_advantages_calls_the_named_estimator_and_flattens():
    batch = synthetic_batch(2, 3, seed=4)
    rewards = [[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]
    out = batch_advantages(batch, rewards, AdvantageConfig(fn="nodes.driver.advantage:leave_one_out"))
    assert out == pytest.approx([1.0, -0.5, -0.5, -0.5, -0.5, 1.0])
    out = batch_advantages(batch, rewards, AdvantageConfig(fn="tests.trainer.test_advantage:constant"))
    assert out == [0.25] * 6
    with pytest.raises(ValueError, match=r"advantage\.fn.*has no 'nope'"):
        batch_advantages(batch, rewards, AdvantageConfig(fn="nodes.driver.advantage:nope"))
    with pytest.raises(ValueError, match="other sizes"):
        batch_advantages(batch, rewards, AdvantageConfig(fn="tests.trainer.test_advantage:too_few"))


def constant(rewards, cfg):
    return [[0.25] * len(g) for g in rewards]


def too_few(rewards, cfg):
    return [g[:1] for g in rewards]


@dataclass
class ScaleSettings:
    factor: float = 1.0


def scaled(rewards, cfg):
    """An estimator with its own settings: ``cfg.fn_args.factor`` times the reward."""
    return [[cfg.fn_args.factor * r for r in g] for g in rewards]


scaled.config_class = ScaleSettings


def test_an_estimator_reads_its_own_settings():
    batch = synthetic_batch(1, 2, seed=0)
    cfg = AdvantageConfig(fn="tests.trainer.test_advantage:scaled", fn_args=ScaleSettings(factor=3.0))
    assert batch_advantages(batch, [[1.0, 0.5]], cfg) == [3.0, 1.5]
