"""Synthetic GRPO batches with controllable length distributions, for tests and benchmarks."""

from __future__ import annotations

import math
import random

from protocols.rl import Batch, Trajectory, TrajectoryGroup

__all__ = ["grpo_advantages", "skewed_lengths", "synthetic_batch", "with_advantages"]


def skewed_lengths(
    n: int, rng: random.Random, median: int = 256, sigma: float = 1.0, lo: int = 4, hi: int = 8192
) -> list[int]:
    """Log-normal lengths: most short, a long tail (what RL generations look like)."""
    return [min(hi, max(lo, round(median * math.exp(rng.gauss(0.0, sigma))))) for _ in range(n)]


def synthetic_batch(
    n_groups: int,
    group_size: int,
    *,
    seed: int = 0,
    vocab: int = 1000,
    prompt_len: tuple[int, int] = (3, 8),
    gen_len: tuple[int, int] = (2, 12),
    gen_lengths: list[int] | None = None,
    version: int = 0,
    max_lag: int = 0,
    logprob_mean: float = -10.8,
    logprob_noise: float = 0.5,
) -> Batch:
    """A valid :class:`Batch` of random tokens, 0/1 rewards and plausible behaviour log-probs.

    ``gen_lengths`` (one per trajectory) overrides ``gen_len``; token versions lag ``version`` by
    up to ``max_lag``. The default log-prob mean is that of a uniform policy over a 49152-token
    vocabulary, near what a random tiny model gives, so behaviour weights land around 1.
    """
    rng = random.Random(seed)
    groups = []
    k = 0
    for g in range(n_groups):
        gid = f"g{seed}-{g}"
        p = rng.randint(*prompt_len)
        prompt = [rng.randrange(vocab) for _ in range(p)]
        trajs = []
        for _ in range(group_size):
            n = gen_lengths[k] if gen_lengths is not None else rng.randint(*gen_len)
            k += 1
            gen = [rng.randrange(vocab) for _ in range(n)]
            v = max(0, version - rng.randint(0, max_lag))
            trajs.append(
                Trajectory(
                    input_ids=prompt + gen,
                    loss_mask=[0] * p + [1] * n,
                    logprobs=[0.0] * p + [min(0.0, rng.gauss(logprob_mean, logprob_noise)) for _ in range(n)],
                    versions=[-1] * p + [v] * n,
                    reward=float(rng.random() < 0.5),
                    group_id=gid,
                    prompt_len=p,
                )
            )
        groups.append(TrajectoryGroup(group_id=gid, trajectories=trajs))
    batch = Batch(groups=groups, version=version)
    batch.validate()
    return batch


def grpo_advantages(batch: Batch) -> list[float]:
    """GRPO advantages of the batch's unshaped rewards (nodes/driver/advantage.py), one per trajectory:
    what tests and benchmarks that drive a trainer directly train with."""
    from nodes.driver.advantage import AdvantageConfig, batch_advantages

    return batch_advantages(batch, [g.rewards for g in batch.groups], AdvantageConfig())


def with_advantages(batch: Batch) -> Batch:
    """``batch`` with :func:`grpo_advantages` on it (``batch.advantages``), ready to train on."""
    batch.advantages = grpo_advantages(batch)
    return batch
