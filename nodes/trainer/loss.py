"""GRPO advantages and the decoupled PPO objective (AReaL's asynchronous-RL loss).

Three policies meet in the loss: the *behaviour* policy that sampled the tokens (its log-probs
come back from the inference server, possibly several versions old), the *proximal* policy (the
trainer's weights at the start of this step, log-probs recomputed without grad), and the current
policy being updated. The PPO ratio and its clip are taken against the proximal policy; the
off-policyness of the samples is corrected by the behaviour importance weight
``exp(prox - behave)``. Tokens whose behaviour weight exceeds ``behav_imp_weight_cap`` are masked
out of the loss (they still count in the token-mean denominator), as AReaL does.

Losses are returned as token *sums* plus the statistics as sums, maxima and minima, so a
micro-batched, multi-rank step can divide by the global token count and reduce the statistics.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = [
    "AdvantageConfig",
    "LossConfig",
    "LossSums",
    "batch_normalize",
    "decoupled_ppo_loss",
    "gather_logprobs_entropy",
    "group_advantages",
]


@dataclass
class AdvantageConfig:
    """How sequence rewards become advantages (GRPO: one scalar per sequence, on all its tokens)."""

    reward_bias: float = 0.0
    reward_scaling: float = 1.0
    reward_clip: float = 20.0
    group_mean: bool = True  # subtract the group's mean reward
    group_std: bool = True  # divide by the group's reward std
    leave_one_out: bool = False  # the mean excludes the sequence itself (RLOO baseline)
    batch_norm: bool = False  # then normalise over all loss tokens of the batch
    eps: float = 1e-5

    def __post_init__(self) -> None:
        _require(self.reward_clip > 0, "reward_clip", "> 0", self.reward_clip)
        _require(self.eps > 0, "eps", "> 0", self.eps)


@dataclass
class LossConfig:
    """The decoupled PPO objective's knobs (defaults follow AReaL's GSM8K GRPO recipe)."""

    eps_clip: float = 0.4
    eps_clip_higher: float | None = None  # asymmetric upper clip (DAPO's clip-higher)
    c_clip: float | None = None  # dual clip for negative advantages; must be > 1
    behav_imp_weight_cap: float | None = 5.0
    temperature: float = 1.0  # logits / T, as the server sampled
    kl_coef: float = 0.0  # k3 KL to a reference model, added to the loss

    def __post_init__(self) -> None:
        _require(0 < self.eps_clip < 1, "eps_clip", "in (0, 1)", self.eps_clip)
        high = self.eps_clip_higher
        _require(high is None or high > 0, "eps_clip_higher", "> 0 or unset", high)
        _require(self.c_clip is None or self.c_clip > 1, "c_clip", "> 1 or unset", self.c_clip)
        cap = self.behav_imp_weight_cap
        _require(cap is None or cap > 0, "behav_imp_weight_cap", "> 0 or unset", cap)
        _require(self.temperature >= 0, "temperature", ">= 0", self.temperature)
        _require(self.kl_coef >= 0, "kl_coef", ">= 0", self.kl_coef)


def _require(ok: bool, key: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"'{key}' must be {allowed}, got {value!r}")


def group_advantages(rewards: Sequence[Sequence[float]], cfg: AdvantageConfig) -> list[list[float]]:
    """Scale, clip and normalise each group's rewards into one advantage per sequence."""
    out: list[list[float]] = []
    for group in rewards:
        r = [
            min(max((x + cfg.reward_bias) * cfg.reward_scaling, -cfg.reward_clip), cfg.reward_clip)
            for x in group
        ]
        n = len(r)
        if cfg.group_mean and n > 1:
            total = sum(r)
            base = [(total - x) / (n - 1) for x in r] if cfg.leave_one_out else [total / n] * n
        elif cfg.group_mean:  # a lone sample has no baseline to compare with: advantage 0
            base = list(r)
        else:
            base = [0.0] * n
        adv = [x - b for x, b in zip(r, base, strict=True)]
        if cfg.group_std and n > 1:
            mean = sum(r) / n
            std = math.sqrt(sum((x - mean) ** 2 for x in r) / n)
            adv = [a / (std + cfg.eps) for a in adv]
        out.append(adv)
    return out


def batch_normalize(advantages: Sequence[float], n_tokens: Sequence[int], eps: float = 1e-5) -> list[float]:
    """Normalise per-sequence advantages to zero mean, unit std over all loss tokens of a batch
    (each sequence weighted by its count of loss tokens, as token-level normalisation would)."""
    total = sum(n_tokens)
    if total == 0:
        return list(advantages)
    mean = sum(a * n for a, n in zip(advantages, n_tokens, strict=True)) / total
    var = sum(n * (a - mean) ** 2 for a, n in zip(advantages, n_tokens, strict=True)) / total
    return [(a - mean) / (math.sqrt(var) + eps) for a in advantages]


def gather_logprobs_entropy(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each label under ``softmax(logits / T)`` and that distribution's entropy.

    The temperature must match the one the server sampled with, or the ratios are off-policy
    even for fresh samples. Greedy sampling (``T = 0``) reports ``T = 1`` log-probs, so 0 means 1
    here. Computed in at least fp32.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> fp32, fp64 stays
    logp_all = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


@dataclass
class LossSums:
    """A micro-batch's loss as a token sum (divide by the global loss-token count) and its stats.

    ``sums`` are token sums (divide by ``n_tokens`` after reducing), ``maxes``/``mins`` reduce by
    max/min (±inf when the micro-batch has no loss tokens). All are 0-d tensors on the logits'
    device, so a step can stack and all-reduce them once instead of syncing per micro-batch.
    """

    loss_sum: torch.Tensor
    n_tokens: torch.Tensor
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    maxes: dict[str, torch.Tensor] = field(default_factory=dict)
    mins: dict[str, torch.Tensor] = field(default_factory=dict)


def decoupled_ppo_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behave_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: LossConfig,
    entropy: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
) -> LossSums:
    """The decoupled PPO loss summed over the loss tokens (all inputs aligned, same shape).

    ``logp`` carries the grad; the other log-prob tensors are constants. The caller divides
    ``loss_sum`` by the number of loss tokens in the whole (multi-rank) minibatch.
    """
    mask = loss_mask.bool()
    prox_logp, behave_logp = prox_logp.detach(), behave_logp.detach()
    ratio = torch.where(mask, torch.exp(logp - prox_logp), torch.zeros_like(logp))
    upper = 1.0 + (cfg.eps_clip if cfg.eps_clip_higher is None else cfg.eps_clip_higher)
    clipped = ratio.clamp(1.0 - cfg.eps_clip, upper)
    loss1, loss2 = -advantages * ratio, -advantages * clipped
    pg = torch.maximum(loss1, loss2)
    clip_mask = (loss1.detach() < loss2.detach()) & mask
    dual_mask = torch.zeros_like(mask)
    if cfg.c_clip is not None:
        if cfg.c_clip <= 1.0:
            raise ValueError(f"c_clip must be > 1, got {cfg.c_clip}")
        bound = cfg.c_clip * advantages.abs()  # binds only where the advantage is negative
        dual_mask = (bound < pg.detach()) & mask
        pg = torch.minimum(pg, bound)

    behave_kl = prox_logp - behave_logp
    behave_w = behave_kl.exp()
    behave_mask = mask if cfg.behav_imp_weight_cap is None else mask & (behave_w <= cfg.behav_imp_weight_cap)
    behave_w = torch.where(behave_mask, behave_w, torch.zeros_like(behave_w))
    token_loss = torch.where(mask, pg * behave_w, torch.zeros_like(pg))

    ref_kl = None
    if ref_logp is not None and cfg.kl_coef:
        d = ref_logp.detach() - logp
        ref_kl = torch.where(mask, d.exp() - d - 1.0, torch.zeros_like(d))  # k3, unbiased, >= 0
        token_loss = token_loss + cfg.kl_coef * ref_kl

    out = LossSums(loss_sum=token_loss.sum(), n_tokens=mask.sum())
    with torch.no_grad():  # stats stay tensors: no device sync per micro-batch
        m = mask.to(logp.dtype)
        out.sums = {
            "loss": token_loss.detach().sum(),
            "clip_frac": clip_mask.sum(),
            "dual_clip_frac": dual_mask.sum(),
            "ratio": ratio.detach().sum(),
            "approx_kl": ((logp.detach() - prox_logp) * m).sum(),
            "behave_imp_weight": behave_w.sum(),
            "behave_approx_kl": (behave_kl * behave_mask).sum(),
            "behave_masked_frac": (mask & ~behave_mask).sum(),
            "advantage": (advantages * m).sum(),
        }
        if entropy is not None:
            out.sums["entropy"] = (entropy.detach() * m).sum()
        if ref_kl is not None:
            out.sums["ref_kl"] = ref_kl.detach().sum()
        inf = torch.full_like(ratio, math.inf)
        r = ratio.detach()
        out.maxes = {
            "ratio_max": torch.where(mask, r, -inf).max(),
            "behave_imp_weight_max": torch.where(mask, behave_kl.exp(), -inf).max(),
        }
        out.mins = {"ratio_min": torch.where(mask, r, inf).min()}
    return out
