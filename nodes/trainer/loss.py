"""The decoupled PPO objective (AReaL's asynchronous-RL loss), the default ``[trainer.loss] fn``.

Three policies meet in the loss: the *behaviour* policy that sampled the tokens (its log-probs
come back from the inference server, possibly several versions old), the *proximal* policy (the
trainer's weights at the start of this step, log-probs recomputed without grad), and the current
policy being updated. The PPO ratio and its clip are taken against the proximal policy; the
off-policyness of the samples is corrected by the behaviour importance weight
``exp(prox - behave)``. Tokens whose behaviour weight exceeds ``behav_imp_weight_cap`` are masked
out of the loss (they still count in the denominator), as AReaL does.

Corrections for the train-inference mismatch (``[trainer.loss.fn_args]``,
:class:`~nodes.trainer.config.MismatchCorrections`) change that weight, mask tokens or whole
sequences, or make the PPO ratio sequence-level (GSPO); each reports its statistics.

A loss returns a :class:`LossSums`: the loss as a *sum* over tokens or sequences (``mean_over``)
and its statistics in three tables that say how each reduces over micro-batches and ranks (token
sums, reported per loss token; maxima; minima), so a micro-batched, multi-rank step divides by the
global count and reduces statistics it has never heard of. :func:`aggregate` turns token losses
into that sum for ``[trainer.loss] agg``. Another loss is a function with
:func:`decoupled_ppo_loss`'s keyword arguments, named in ``[trainer.loss] fn``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from nodes.trainer.config import DistillConfig, LossConfig, MismatchCorrections

if TYPE_CHECKING:
    import torch

__all__ = [
    "LossConfig",
    "LossSums",
    "MismatchCorrections",
    "aggregate",
    "decoupled_ppo_loss",
    "distill_advantages",
    "gather_logprobs",
    "gather_logprobs_entropy",
]


def _log_softmax(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits / T)`` in at least fp32, with T = 0 (greedy) read as 1."""
    import torch  # here, not at the top: the driver checks `trainer.loss.fn` without importing torch

    if not torch.is_tensor(temperature):
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        temperature = temperature or 1.0
    elif (temperature < 0).any():
        raise ValueError(f"temperature must be >= 0, got {temperature.flatten().tolist()}")
    else:
        temperature = torch.where(temperature == 0, 1.0, temperature)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> fp32, fp64 stays
    return torch.log_softmax(logits / temperature, dim=-1)


def gather_logprobs_entropy(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float | torch.Tensor = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each label under ``softmax(logits / T)`` and that distribution's entropy.

    The temperature must match the one the server sampled with, or the ratios are off-policy
    even for fresh samples. Greedy sampling (``T = 0``) reports ``T = 1`` log-probs, so 0 means 1
    here. ``temperature`` is a number or a tensor that broadcasts against ``logits`` (one per row:
    ``[B, 1, 1]``). Computed in at least fp32.
    """
    logp_all = _log_softmax(logits, temperature)
    logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def gather_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float | torch.Tensor = 1.0
) -> torch.Tensor:
    """The log-probs of :func:`gather_logprobs_entropy`, the same values, without the entropy (its
    pass over every token's whole vocabulary): for the proximal and reference log-probs."""
    return _log_softmax(logits, temperature).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


@dataclass
class LossSums:
    """A micro-batch's loss as a sum (the trainer divides it by the global count of loss tokens, or
    of sequences with a loss token, as ``mean_over`` says) and its statistics.

    ``sums`` are token sums (divide by ``n_tokens`` after reducing), ``maxes``/``mins`` reduce by
    max/min (±inf when the micro-batch has no loss tokens). All are 0-d tensors on the logits'
    device, so a step can stack and all-reduce them once instead of syncing per micro-batch. The
    step's ``loss`` statistic is the trainer's: the objective it differentiated.
    """

    loss_sum: torch.Tensor
    n_tokens: torch.Tensor
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    maxes: dict[str, torch.Tensor] = field(default_factory=dict)
    mins: dict[str, torch.Tensor] = field(default_factory=dict)
    mean_over: Literal["tokens", "sequences"] = "tokens"


def aggregate(
    token_loss: torch.Tensor, loss_mask: torch.Tensor, cfg: LossConfig
) -> tuple[torch.Tensor, Literal["tokens", "sequences"]]:
    """``token_loss`` (``[sequences, tokens]``, zero off the loss mask) as the sum the trainer
    divides by a global count, and which count, for ``cfg.agg``:

    - ``token-mean``: ``sum_it l_it / N_tokens``;
    - ``seq-mean-token-mean``: ``sum_i (sum_t l_it / n_i) / N_seqs`` (GSPO's and GRPO's paper form);
    - ``seq-mean-token-sum``: ``sum_i (sum_t l_it / agg_norm) / N_seqs`` (Dr. GRPO, Liu et al. 2025,
      "Understanding R1-Zero-Like Training": a constant normaliser, no length bias).

    ``n_i`` is sequence ``i``'s loss tokens, ``N_seqs`` counts sequences with at least one. Rows
    are whole sequences, so every per-sequence quantity is local to a micro-batch and the division
    by global counts makes the loss exact across micro-batches and ranks.
    """
    if cfg.agg == "token-mean":
        return token_loss.sum(), "tokens"
    per_seq = token_loss.sum(-1)
    if cfg.agg == "seq-mean-token-mean":
        per_seq = per_seq / loss_mask.sum(-1).clamp(min=1).to(per_seq.dtype)
    elif cfg.agg == "seq-mean-token-sum":
        per_seq = per_seq / cfg.agg_norm
    else:
        raise ValueError(
            f"agg must be token-mean, seq-mean-token-mean or seq-mean-token-sum, got {cfg.agg!r}"
        )
    return per_seq.sum(), "sequences"


def _seq_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Per-row mean of ``x`` over the loss tokens (0 for a row without any)."""
    return (x * m).sum(-1) / m.sum(-1).clamp(min=1)


@dataclass
class ClippedObjective:
    """The PPO term per token, ``max(-A r, -A clip(r, lo, hi))`` (dual clip: ``min(l, c |A|)``),
    with the ratio it used and the tokens each clip bound."""

    loss: torch.Tensor  # per token, zero off the mask
    ratio: torch.Tensor  # r per token (GSPO: the sequence's ratio on each of its tokens)
    seq_ratio: torch.Tensor | None  # GSPO: per sequence; None otherwise
    clipped: torch.Tensor  # tokens where the clipped term was taken
    dual_clipped: torch.Tensor  # tokens the dual clip bound

    def report(self, out: LossSums, mask: torch.Tensor) -> None:
        """Its statistics into ``out``."""
        import torch

        r, inf = self.ratio.detach(), torch.full_like(self.ratio, math.inf)
        out.sums |= {
            "clip_frac": self.clipped.sum(),
            "dual_clip_frac": self.dual_clipped.sum(),
            "ratio": r.sum(),
        }
        out.maxes["ratio_max"] = torch.where(mask, r, -inf).max()
        out.mins["ratio_min"] = torch.where(mask, r, inf).min()
        if self.seq_ratio is not None:
            _seq_extremes(out, "seq_ratio", self.seq_ratio, mask)


def clipped_objective(
    logp: torch.Tensor, prox_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, cfg: LossConfig
) -> ClippedObjective:
    """The PPO ratio ``pi / pi_prox`` (GSPO's sequence ratio with ``fn_args.seq_ratio``), clipped as
    ``cfg`` says, times the advantage."""
    import torch

    corr = _corrections(cfg)
    seq_ratio = None
    if corr.seq_ratio:
        log_s = _seq_mean(logp - prox_logp, mask.to(logp.dtype))
        seq_ratio = log_s.detach().exp()
        ratio = torch.exp(log_s.detach().unsqueeze(-1) + logp - logp.detach())
        lo, hi = 1.0 - corr.seq_eps_clip, 1.0 + corr.seq_eps_clip_higher
    else:
        ratio = torch.exp(logp - prox_logp)
        hi_eps = cfg.eps_clip if cfg.eps_clip_higher is None else cfg.eps_clip_higher
        lo, hi = 1.0 - cfg.eps_clip, 1.0 + hi_eps
    ratio = torch.where(mask, ratio, torch.zeros_like(logp))
    loss1, loss2 = -advantages * ratio, -advantages * ratio.clamp(lo, hi)
    pg = torch.maximum(loss1, loss2)
    clipped = (loss1.detach() < loss2.detach()) & mask
    dual = torch.zeros_like(mask)
    if cfg.c_clip is not None:
        if cfg.c_clip <= 1.0:
            raise ValueError(f"c_clip must be > 1, got {cfg.c_clip}")
        bound = cfg.c_clip * advantages.abs()  # binds only where the advantage is negative
        dual = (bound < pg.detach()) & mask
        pg = torch.minimum(pg, bound)
    return ClippedObjective(torch.where(mask, pg, torch.zeros_like(pg)), ratio, seq_ratio, clipped, dual)


@dataclass
class BehaviourWeight:
    """The staleness correction of every token: the behaviour weight ``w = pi_prox / pi_behave``,
    the weight the loss applies (``w``, capped by TIS, 0 where a mask took the token), and what
    each mask took."""

    log_w: torch.Tensor  # log w per token
    w: torch.Tensor
    applied: torch.Tensor  # the weight each token's loss is multiplied by
    keep: torch.Tensor  # loss tokens no mask took
    mis_drop: torch.Tensor  # tokens token MIS / IcePop masked
    geo: torch.Tensor  # per sequence: the geometric-mean w
    geo_drop: torch.Tensor  # tokens of sequences the geometric-mean mask took
    truncated: torch.Tensor  # tokens whose w TIS capped

    def report(self, out: LossSums, mask: torch.Tensor, corr: MismatchCorrections) -> None:
        """Its statistics into ``out`` (those of a correction only when it is on)."""
        import torch

        out.sums |= {
            "behave_imp_weight": self.applied.sum(),
            "behave_approx_kl": (self.log_w * self.keep).sum(),
            "behave_masked_frac": (mask & ~self.keep).sum(),
        }
        out.maxes["behave_imp_weight_max"] = torch.where(mask, self.w, -math.inf).max()
        if corr.tis_cap is not None:
            out.sums["tis_truncated_frac"] = self.truncated.sum()
        if corr.mis_low is not None or corr.mis_high is not None:
            out.sums["mis_masked_frac"] = self.mis_drop.sum()
        if corr.geo_low is not None or corr.geo_high is not None:
            out.sums["geo_masked_frac"] = self.geo_drop.sum()
            _seq_extremes(out, "geo_ratio", self.geo, mask)


def behaviour_weight(
    prox_logp: torch.Tensor, behave_logp: torch.Tensor, mask: torch.Tensor, cfg: LossConfig
) -> BehaviourWeight:
    """Decoupled PPO's behaviour weight with ``behav_imp_weight_cap`` and the corrections of
    ``cfg.fn_args`` (token TIS, token MIS / IcePop, the geometric-mean sequence mask) applied."""
    import torch

    corr = _corrections(cfg)
    log_w = prox_logp - behave_logp
    w = log_w.exp()
    none = torch.zeros_like(mask)
    cap_drop = none if cfg.behav_imp_weight_cap is None else mask & (w > cfg.behav_imp_weight_cap)
    mis_drop = none
    if corr.mis_low is not None:
        mis_drop = mis_drop | (mask & (w < corr.mis_low))
    if corr.mis_high is not None:
        mis_drop = mis_drop | (mask & (w > corr.mis_high))
    geo = _seq_mean(log_w, mask.to(log_w.dtype)).exp()  # per sequence
    seq_drop = torch.zeros_like(geo, dtype=torch.bool)
    if corr.geo_low is not None:
        seq_drop = seq_drop | (geo < corr.geo_low)
    if corr.geo_high is not None:
        seq_drop = seq_drop | (geo > corr.geo_high)
    geo_drop = mask & seq_drop.unsqueeze(-1)
    keep = mask & ~cap_drop & ~mis_drop & ~geo_drop
    truncated = none if corr.tis_cap is None else mask & (w > corr.tis_cap)
    weight = w if corr.tis_cap is None else w.clamp(max=corr.tis_cap)
    applied = torch.where(keep, weight, torch.zeros_like(weight))
    return BehaviourWeight(log_w, w, applied, keep, mis_drop, geo, geo_drop, truncated)


def reference_kl(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The k3 estimate of KL(pi || pi_ref) per token (unbiased, >= 0), zero off the mask."""
    import torch

    d = ref_logp.detach() - logp
    return torch.where(mask, d.exp() - d - 1.0, torch.zeros_like(d))


def distill_advantages(
    advantages: torch.Tensor,
    teacher_logp: torch.Tensor,
    prox_logp: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: DistillConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """On-policy distillation's advantage per token, ``reward_coef * A + coef * (log pi_teacher -
    log pi_prox)``, and the reverse KL estimate per token, ``log pi_prox - log pi_teacher`` (both
    zero off the mask).

    The tokens were sampled from the policy, so ``log pi - log pi_teacher`` at each is a one-sample
    estimate of the per-token reverse KL ``KL(pi || pi_teacher)``; its negative, as an advantage
    under the policy gradient, lowers it (Agarwal et al. 2024, "On-Policy Distillation of Language
    Models: Learning from Self-Generated Mistakes"; Thinking Machines, "On-Policy Distillation",
    2025). It is a constant of the step (the proximal policy's, like the group advantage), so the
    PPO clip and the behaviour weight apply to it as to the reward's: any loss function taking
    ``advantages`` distils unchanged."""
    import torch

    mask = loss_mask.bool()
    reverse_kl = torch.where(mask, prox_logp.detach() - teacher_logp.detach(), torch.zeros_like(prox_logp))
    combined = cfg.reward_coef * advantages - cfg.coef * reverse_kl
    return torch.where(mask, combined, torch.zeros_like(combined)), reverse_kl


def _corrections(cfg: LossConfig) -> MismatchCorrections:
    return cfg.fn_args if isinstance(cfg.fn_args, MismatchCorrections) else MismatchCorrections()


def _seq_extremes(out: LossSums, name: str, per_seq: torch.Tensor, mask: torch.Tensor) -> None:
    """``<name>_max`` and ``<name>_min`` of a per-sequence statistic over the sequences with loss tokens."""
    import torch

    has_tokens = mask.any(-1)
    out.maxes[f"{name}_max"] = torch.where(has_tokens, per_seq, -math.inf).max()
    out.mins[f"{name}_min"] = torch.where(has_tokens, per_seq, math.inf).min()


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
    """The decoupled PPO loss over the loss tokens (inputs ``[sequences, tokens]``, aligned),
    aggregated as ``cfg.agg`` says (:func:`aggregate`).

    ``logp`` carries the grad; the other log-prob tensors are constants. Per token, with
    ``r = pi / pi_prox`` and behaviour weight ``w = pi_prox / pi_behave``:
    ``l = w * max(-A r, -A clip(r, 1 - eps, 1 + eps_high))`` (dual clip: ``min(l, c A)`` for
    ``A < 0``), plus ``kl_coef * k3(ref)``. The corrections of ``cfg.fn_args``
    (:class:`MismatchCorrections`) compose with it:

    - token TIS, ``tis_cap = C``: ``w -> min(w, C)`` (Yao et al. 2025, "Your efficient RL framework
      secretly brings you off-policy RL training"; verl ``docs/algo/rollout_corr.md``, token IS);
    - token MIS / IcePop, ``mis_low, mis_high``: tokens with ``w`` outside ``[low, high]`` are
      masked (``w = 0``; verl's token rejection sampling; IcePop, Ling Team 2025, "Every Step
      Evolves" (Ring-1T): a two-sided mask on the train/inference ratio, ``[0.5, 5]``);
    - geometric-mean sequence mask, ``geo_low, geo_high``: a sequence whose
      ``exp(mean_t log w_t)`` is outside ``[low, high]`` is masked whole (verl's geometric
      rejection sampling; Liu, Li et al. 2025, "When Speed Kills Stability");
    - ``seq_ratio`` (GSPO, Zheng et al. 2025, "Group Sequence Policy Optimization"): ``r`` becomes
      the sequence ratio ``s_i = exp(mean_t log(pi / pi_prox))``, clipped at
      ``[1 - seq_eps_clip, 1 + seq_eps_clip_higher]``, in the paper's GSPO-token form (value
      ``s_i`` on every token, gradient ``s_i * grad log pi_t``): with ``seq-mean-token-mean``
      its gradient is GSPO's. The behaviour weight stays per token (decoupled PPO).

    The cap, MIS and the sequence mask all mask; masked tokens still count in the denominator.
    The terms are :func:`clipped_objective`, :func:`behaviour_weight` and :func:`reference_kl`.
    """
    import torch

    mask = loss_mask.bool()
    m = mask.to(logp.dtype)
    prox_logp, behave_logp = prox_logp.detach(), behave_logp.detach()
    pg = clipped_objective(logp, prox_logp, advantages, mask, cfg)
    bw = behaviour_weight(prox_logp, behave_logp, mask, cfg)
    token_loss = pg.loss * bw.applied
    ref_kl = None
    if ref_logp is not None and cfg.kl_coef:
        ref_kl = reference_kl(logp, ref_logp, mask)
        token_loss = token_loss + cfg.kl_coef * ref_kl

    loss_sum, mean_over = aggregate(token_loss, m, cfg)
    out = LossSums(loss_sum=loss_sum, n_tokens=mask.sum(), mean_over=mean_over)
    with torch.no_grad():  # stats stay tensors: no device sync per micro-batch
        out.sums = {
            "token_loss": token_loss.detach().sum(),
            "approx_kl": ((logp.detach() - prox_logp) * m).sum(),
            "advantage": (advantages * m).sum(),
        }
        if entropy is not None:
            out.sums["entropy"] = (entropy.detach() * m).sum()
        if ref_kl is not None:
            out.sums["ref_kl"] = ref_kl.detach().sum()
        pg.report(out, mask)
        bw.report(out, mask, _corrections(cfg))
    return out


decoupled_ppo_loss.config_class = MismatchCorrections  # type: ignore[attr-defined]
