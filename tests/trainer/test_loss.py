"""The decoupled PPO loss against direct hand-written computations."""

from __future__ import annotations

import math

import pytest
import torch

from nodes.trainer.loss import LossConfig, decoupled_ppo_loss, gather_logprobs_entropy


def _reference_loss(logits, labels, prox, behave, adv, mask, cfg: LossConfig, T: float, ref=None):
    """Token by token, straight from the objective's definition, with python scalars around autograd."""
    total = 0.0
    n = sum(int(m) for m in mask.flatten())
    for b in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            if not mask[b, t]:
                continue
            z = logits[b, t] / T
            lp = z[labels[b, t]] - torch.logsumexp(z, dim=0)
            r = torch.exp(lp - prox[b, t])
            a = adv[b, t]
            hi = 1 + (cfg.eps_clip if cfg.eps_clip_higher is None else cfg.eps_clip_higher)
            rc = torch.clamp(r, 1 - cfg.eps_clip, hi)
            term = torch.maximum(-a * r, -a * rc)
            if cfg.c_clip is not None and a < 0:
                term = torch.minimum(term, -cfg.c_clip * a)
            w = math.exp(float(prox[b, t] - behave[b, t]))
            if cfg.behav_imp_weight_cap is not None and w > cfg.behav_imp_weight_cap:
                w = 0.0  # masked out, still counted in n
            term = term * w
            if ref is not None and cfg.kl_coef:
                d = ref[b, t] - lp
                term = term + cfg.kl_coef * (torch.exp(d) - d - 1)
            total = total + term
    return total / n


@pytest.mark.parametrize(
    ("cfg", "T"),
    [
        (LossConfig(eps_clip=0.2, behav_imp_weight_cap=None), 1.0),
        (LossConfig(eps_clip=0.2, eps_clip_higher=0.3, behav_imp_weight_cap=1.5), 0.7),
        (LossConfig(eps_clip=0.1, c_clip=3.0, behav_imp_weight_cap=2.0, kl_coef=0.05), 1.0),
    ],
    ids=["plain", "cap+clip_higher+T", "dual_clip+kl"],
)
def test_loss_and_gradient_match_hand_written(cfg, T):
    g = torch.Generator().manual_seed(0)
    B, T, V = 3, 7, 11
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, V, (B, T), generator=g)
    with torch.no_grad():
        cur, _ = gather_logprobs_entropy(logits, labels, T)
    # proximal and behaviour policies a little (and sometimes a lot) away from the current one
    prox = cur + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    behave = prox - 0.8 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = cur + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).contiguous()
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[:, 0] = False

    logp, ent = gather_logprobs_entropy(logits, labels, T)
    out = decoupled_ppo_loss(logp, prox, behave, adv, mask, cfg, entropy=ent, ref_logp=ref)
    loss = out.loss_sum / out.n_tokens
    (grad,) = torch.autograd.grad(loss, logits)

    ref_loss = _reference_loss(logits, labels, prox, behave, adv, mask, cfg, T, ref=ref)
    (ref_grad,) = torch.autograd.grad(ref_loss, logits)
    assert int(out.n_tokens) == int(mask.sum())
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)
    assert grad.abs().sum() > 0
    # masked positions get no gradient
    assert torch.all(grad[~mask] == 0)
    # stats are consistent with the direct computation
    assert math.isclose(float(out.sums["loss"]), float(out.loss_sum.detach()), rel_tol=1e-12)
    w = torch.exp(prox - behave)[mask]
    if cfg.behav_imp_weight_cap is not None:
        assert int(out.sums["behave_masked_frac"]) == int((w > cfg.behav_imp_weight_cap).sum())
        assert out.sums["behave_masked_frac"] > 0  # the case is exercised
    r = torch.exp(logp - prox)[mask]
    a = adv[mask]
    lo, hi = 1 - cfg.eps_clip, 1 + (cfg.eps_clip_higher or cfg.eps_clip)
    expect_clip = int((((a > 0) & (r > hi)) | ((a < 0) & (r < lo))).sum())
    assert int(out.sums["clip_frac"]) == expect_clip
    assert math.isclose(float(out.maxes["ratio_max"]), float(r.detach().max()), rel_tol=1e-12)


def test_logprobs_use_temperature_and_entropy_is_correct():
    logits = torch.tensor([[2.0, 0.0, -1.0]])
    logp, ent = gather_logprobs_entropy(logits, torch.tensor([0]), temperature=2.0)
    p = torch.softmax(logits / 2.0, -1)
    assert torch.allclose(logp, p[:, 0].log())
    assert torch.allclose(ent, -(p * p.log()).sum(-1))


def test_fresh_samples_give_plain_policy_gradient():
    # on-policy (prox == behave == current): ratio 1, no clipping, loss = -mean(advantage)
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.125]], requires_grad=True))
    adv = torch.tensor([[1.0, 1.0, -2.0]])
    out = decoupled_ppo_loss(logp, logp.detach(), logp.detach(), adv, torch.ones(1, 3), LossConfig())
    assert math.isclose(float(out.loss_sum.detach()) / int(out.n_tokens), 0.0, abs_tol=1e-7)
    assert int(out.sums["clip_frac"]) == 0 and int(out.sums["behave_masked_frac"]) == 0


def test_greedy_temperature_means_unscaled_logprobs():
    logits, labels = torch.randn(3, 7, dtype=torch.float64), torch.tensor([1, 4, 6])
    greedy, ent0 = gather_logprobs_entropy(logits, labels, 0.0)
    plain, ent1 = gather_logprobs_entropy(logits, labels, 1.0)
    assert torch.equal(greedy, plain) and torch.equal(ent0, ent1) and torch.isfinite(greedy).all()
    with pytest.raises(ValueError, match="temperature"):
        gather_logprobs_entropy(logits, labels, -1.0)


def test_each_row_is_scored_at_its_own_temperature():
    """A micro-batch's rows carry their trajectories' sampling temperatures (0 = greedy = 1)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, 7, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 7, (3, 5), generator=g)
    temps = torch.tensor([0.5, 1.0, 0.0], dtype=torch.float64).view(3, 1, 1)
    logp, ent = gather_logprobs_entropy(logits, labels, temps)
    for row, t in enumerate((0.5, 1.0, 1.0)):
        want, want_ent = gather_logprobs_entropy(logits[row : row + 1], labels[row : row + 1], t)
        assert torch.allclose(logp[row], want[0]) and torch.allclose(ent[row], want_ent[0])
    with pytest.raises(ValueError, match="temperature"):
        gather_logprobs_entropy(logits, labels, -temps)
