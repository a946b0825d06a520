"""The decoupled PPO objective (AReaL's asynchronous-RL loss), the default ``[trainer.loss] fn``.

Three policies meet in the loss: the *behaviour* policy that sampled the tokens (its log-probs
come back from the inference server, possibly several versions old), the *proximal* policy (the
trainer's weights at the start of this step, log-probs recomputed without grad), and the current
policy being updated. The PPO ratio and its clip are taken against the proximal policy; the
off-policyness of the samples is corrected by the behaviour importance weight
``exp(prox - behave)``. Tokens whose behaviour weight exceeds ``behav_imp_weight_cap`` are masked
out of the loss (they still count in the token-mean denominator), as AReaL does.

A loss returns a :class:`LossSums`: the loss as a token *sum* and its statistics in three
tables that say how each reduces over micro-batches and ranks (token sums, reported per loss
token; maxima; minima), so a micro-batched, multi-rank step divides by the global token count and
reduces statistics it has never heard of. Another loss is a function with
:func:`decoupled_ppo_loss`'s keyword arguments, named in ``[trainer.loss] fn``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from nodes.trainer.config import LossConfig

__all__ = ["LossConfig", "LossSums", "decoupled_ppo_loss", "gather_logprobs_entropy"]


def gather_logprobs_entropy(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float | torch.Tensor = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each label under ``softmax(logits / T)`` and that distribution's entropy.

    The temperature must match the one the server sampled with, or the ratios are off-policy
    even for fresh samples. Greedy sampling (``T = 0``) reports ``T = 1`` log-probs, so 0 means 1
    here. ``temperature`` is a number or a tensor that broadcasts against ``logits`` (one per row:
    ``[B, 1, 1]``). Computed in at least fp32.
    """
    if not torch.is_tensor(temperature):
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        temperature = temperature or 1.0
    elif (temperature < 0).any():
        raise ValueError(f"temperature must be >= 0, got {temperature.flatten().tolist()}")
    else:
        temperature = torch.where(temperature == 0, 1.0, temperature)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> fp32, fp64 stays
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
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
