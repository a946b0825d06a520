"""A reward, an advantage estimator and a loss of a researcher's own, named by import path in
test_custom_algorithm.py: each leaves a mark the test can read back from metrics.jsonl."""

from __future__ import annotations

import torch

from nodes.trainer.loss import LossSums, decoupled_ppo_loss


def quarter_reward(completion: str, item: dict) -> float:
    """0.25 for every completion: the run's reward/mean must be exactly this."""
    return 0.25


def rank_advantage(rewards: list[list[float]], cfg) -> list[list[float]]:
    """Advantages that do not depend on the (constant) rewards, so the loss has a signal."""
    return [[1.0 if i % 2 == 0 else -1.0 for i in range(len(g))] for g in rewards]


def marked_ppo_loss(**kw) -> LossSums:
    """The default loss plus statistics of its own, one per reduction table."""
    out = decoupled_ppo_loss(**kw)
    mask = kw["loss_mask"].bool()
    adv = kw["advantages"]
    out.sums["custom/token_share"] = mask.sum().to(torch.float64)  # per loss token: exactly 1
    out.maxes["custom/adv_max"] = torch.where(mask, adv, torch.full_like(adv, -1e9)).max()
    out.mins["custom/adv_min"] = torch.where(mask, adv, torch.full_like(adv, 1e9)).min()
    return out
