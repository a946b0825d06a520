"""Reward shaping and the shipped advantage estimators against hand-computed values; an estimator
named by import path is what the batch gets."""

from __future__ import annotations

import math

import pytest

from nodes.advantage import (
    AdvantageConfig,
    ShapingConfig,
    batch_advantages,
    batch_normalize,
    dr_grpo,
    grpo,
    leave_one_out,
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
    out = batch_advantages(batch, rewards, AdvantageConfig(fn="nodes.advantage:leave_one_out"))
    assert out == pytest.approx([1.0, -0.5, -0.5, -0.5, -0.5, 1.0])
    out = batch_advantages(batch, rewards, AdvantageConfig(fn="tests.trainer.test_advantage:constant"))
    assert out == [0.25] * 6
    with pytest.raises(ValueError, match=r"advantage\.fn.*has no 'nope'"):
        batch_advantages(batch, rewards, AdvantageConfig(fn="nodes.advantage:nope"))
    with pytest.raises(ValueError, match="other sizes"):
        batch_advantages(batch, rewards, AdvantageConfig(fn="tests.trainer.test_advantage:too_few"))


def constant(rewards, cfg):
    return [[0.25] * len(g) for g in rewards]


def too_few(rewards, cfg):
    return [g[:1] for g in rewards]
