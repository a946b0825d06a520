"""The decoupled PPO loss, its mismatch corrections and aggregation modes against direct
hand-written computations."""

from __future__ import annotations

import math

import pytest
import torch

from nodes.trainer.loss import LossConfig, MismatchCorrections, decoupled_ppo_loss, gather_logprobs_entropy


def _reference_loss(logits, labels, prox, behave, adv, mask, cfg: LossConfig, T: float, ref=None):
    """Token by token, straight from the objective's definition, with python scalars around autograd;
    then aggregated over sequences (rows) as ``cfg.agg`` says."""
    corr = cfg.fn_args
    per_seq = []  # (token terms of the sequence) for each row with loss tokens
    for b in range(logits.shape[0]):
        toks = [t for t in range(logits.shape[1]) if mask[b, t]]
        if not toks:
            continue
        lps = {}
        for t in toks:
            z = logits[b, t] / T
            lps[t] = z[labels[b, t]] - torch.logsumexp(z, dim=0)
        log_w = [float(prox[b, t] - behave[b, t]) for t in toks]
        geo = math.exp(sum(log_w) / len(log_w))
        seq_masked = (corr.geo_low is not None and geo < corr.geo_low) or (
            corr.geo_high is not None and geo > corr.geo_high
        )
        if corr.seq_ratio:  # GSPO-token: the value of s_i, the gradient of s_i * log pi_t
            s = torch.exp(sum(lps[t] - prox[b, t] for t in toks) / len(toks)).detach()
        terms = []
        for t in toks:
            lp = lps[t]
            a = adv[b, t]
            if corr.seq_ratio:
                r = s * torch.exp(lp - lp.detach())
                lo, hi = 1 - corr.seq_eps_clip, 1 + corr.seq_eps_clip_higher
            else:
                r = torch.exp(lp - prox[b, t])
                lo = 1 - cfg.eps_clip
                hi = 1 + (cfg.eps_clip if cfg.eps_clip_higher is None else cfg.eps_clip_higher)
            term = torch.maximum(-a * r, -a * torch.clamp(r, lo, hi))
            if cfg.c_clip is not None and a < 0:
                term = torch.minimum(term, -cfg.c_clip * a)
            w = math.exp(float(prox[b, t] - behave[b, t]))
            masked = (
                (cfg.behav_imp_weight_cap is not None and w > cfg.behav_imp_weight_cap)
                or (corr.mis_low is not None and w < corr.mis_low)
                or (corr.mis_high is not None and w > corr.mis_high)
                or seq_masked
            )
            if corr.tis_cap is not None:
                w = min(w, corr.tis_cap)
            term = term * (0.0 if masked else w)  # masked out, still counted in the denominator
            if ref is not None and cfg.kl_coef:
                d = ref[b, t] - lp
                term = term + cfg.kl_coef * (torch.exp(d) - d - 1)
            terms.append(term)
        per_seq.append(terms)
    if cfg.agg == "token-mean":
        return sum(sum(ts) for ts in per_seq) / sum(len(ts) for ts in per_seq)
    if cfg.agg == "seq-mean-token-mean":
        return sum(sum(ts) / len(ts) for ts in per_seq) / len(per_seq)
    return sum(sum(ts) / cfg.agg_norm for ts in per_seq) / len(per_seq)


def _inputs(seed: int = 0, B: int = 6, L: int = 7, V: int = 11, spread: float = 0.8):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, L, V, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, V, (B, L), generator=g)
    with torch.no_grad():
        cur, _ = gather_logprobs_entropy(logits, labels, 1.0)
    # proximal and behaviour policies a little (and sometimes a lot) away from the current one
    prox = cur + 0.5 * torch.randn(B, L, generator=g, dtype=torch.float64)
    behave = prox - spread * torch.randn(B, L, generator=g, dtype=torch.float64)
    ref = cur + 0.3 * torch.randn(B, L, generator=g, dtype=torch.float64)
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, L).contiguous()
    mask = torch.rand(B, L, generator=g) < 0.7
    mask[:, 0] = False
    return logits, labels, prox, behave, ref, adv, mask


MC = MismatchCorrections
CASES = {
    "plain": (LossConfig(eps_clip=0.2, behav_imp_weight_cap=None), 1.0),
    "cap+clip_higher+T": (LossConfig(eps_clip=0.2, eps_clip_higher=0.3, behav_imp_weight_cap=1.5), 0.7),
    "dual_clip+kl": (LossConfig(eps_clip=0.1, c_clip=3.0, behav_imp_weight_cap=2.0, kl_coef=0.05), 1.0),
    "tis": (LossConfig(eps_clip=0.2, behav_imp_weight_cap=None, fn_args=MC(tis_cap=1.2)), 1.0),
    "mis": (LossConfig(eps_clip=0.2, behav_imp_weight_cap=None, fn_args=MC(mis_low=0.5, mis_high=2.0)), 1.0),
    "geo_mask+tis": (
        LossConfig(behav_imp_weight_cap=None, fn_args=MC(geo_low=0.8, geo_high=1.25, tis_cap=2)),
        1,
    ),
    "gspo": (LossConfig(behav_imp_weight_cap=3.0, fn_args=MC(seq_ratio=True, seq_eps_clip=0.05)), 1.0),
    "seq-mean-token-mean": (LossConfig(eps_clip=0.2, agg="seq-mean-token-mean"), 0.7),
    "seq-mean-token-sum": (LossConfig(c_clip=3.0, agg="seq-mean-token-sum", agg_norm=5.0), 1.0),
    "gspo+seq-mean+icepop": (
        LossConfig(agg="seq-mean-token-mean", fn_args=MC(seq_ratio=True, mis_low=0.5, mis_high=5.0)),
        1.0,
    ),
}


@pytest.mark.parametrize(("cfg", "T"), list(CASES.values()), ids=list(CASES))
def test_loss_and_gradient_match_hand_written(cfg, T):
    logits, labels, prox, behave, ref, adv, mask = _inputs()
    logp, ent = gather_logprobs_entropy(logits, labels, T)
    out = decoupled_ppo_loss(logp, prox, behave, adv, mask, cfg, entropy=ent, ref_logp=ref)
    n_seqs = int(mask.any(-1).sum())
    assert out.mean_over == ("tokens" if cfg.agg == "token-mean" else "sequences")
    loss = out.loss_sum / (out.n_tokens if out.mean_over == "tokens" else n_seqs)
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
    w = torch.exp(prox - behave)[mask]
    corr = cfg.fn_args
    if cfg.behav_imp_weight_cap is not None and corr.geo_low is None and corr.mis_low is None:
        assert int(out.sums["behave_masked_frac"]) == int((w > cfg.behav_imp_weight_cap).sum())
        assert out.sums["behave_masked_frac"] > 0  # the case is exercised
    if corr.tis_cap is not None:
        assert int(out.sums["tis_truncated_frac"]) == int((w > corr.tis_cap).sum()) > 0
    if corr.mis_low is not None:
        assert int(out.sums["mis_masked_frac"]) == int(((w < corr.mis_low) | (w > corr.mis_high)).sum()) > 0
    if corr.geo_low is not None:
        m = mask.double()
        geo = torch.exp(((prox - behave) * m).sum(-1) / m.sum(-1).clamp(min=1))
        out_seq = ((geo < corr.geo_low) | (geo > corr.geo_high)) & mask.any(-1)
        assert int(out.sums["geo_masked_frac"]) == int(mask[out_seq].sum()) > 0
        assert 0 < out_seq.sum() < n_seqs  # some sequences masked, some kept
        assert math.isclose(float(out.maxes["geo_ratio_max"]), float(geo[mask.any(-1)].max()), rel_tol=1e-12)
    r = torch.exp(logp - prox)[mask]
    a = adv[mask]
    if not corr.seq_ratio:
        lo, hi = 1 - cfg.eps_clip, 1 + (cfg.eps_clip_higher or cfg.eps_clip)
        expect_clip = int((((a > 0) & (r > hi)) | ((a < 0) & (r < lo))).sum())
        assert int(out.sums["clip_frac"]) == expect_clip
        assert math.isclose(float(out.maxes["ratio_max"]), float(r.detach().max()), rel_tol=1e-12)
    else:
        assert out.sums["clip_frac"] > 0  # whole sequences clipped
        assert float(out.maxes["seq_ratio_max"]) >= float(out.mins["seq_ratio_min"])


def test_gspo_gradient_is_the_sequence_level_objective():
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): with the sequence mean over sequences and no behaviour
    correction, the loss and gradient are those of ``mean_i max(-A_i s_i, -A_i clip(s_i))`` with
    ``s_i = (pi(y_i) / pi_prox(y_i)) ** (1 / |y_i|)``, differentiated directly."""
    logits, labels, prox, _, _, adv, mask = _inputs(seed=3, spread=0.0)
    prox = prox * 0.2 + gather_logprobs_entropy(logits, labels)[0].detach() * 0.8  # ratios near 1
    eps = (0.01, 0.02)
    cfg = LossConfig(
        agg="seq-mean-token-mean", fn_args=MC(seq_ratio=True, seq_eps_clip=eps[0], seq_eps_clip_higher=eps[1])
    )
    logp, _ = gather_logprobs_entropy(logits, labels)
    out = decoupled_ppo_loss(logp, prox, prox, adv, mask, cfg)
    rows = [b for b in range(mask.shape[0]) if mask[b].any()]
    loss = out.loss_sum / len(rows)
    (grad,) = torch.autograd.grad(loss, logits)

    logp, _ = gather_logprobs_entropy(logits, labels)
    terms = []
    for b in rows:
        s = torch.exp((logp[b] - prox[b])[mask[b]].mean())
        a = adv[b, 0]
        terms.append(torch.maximum(-a * s, -a * torch.clamp(s, 1 - eps[0], 1 + eps[1])))
    want = sum(terms) / len(rows)
    (want_grad,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-9, atol=1e-12)
    assert grad.abs().sum() > 0 and out.sums["clip_frac"] > 0  # some sequences clipped, some not


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
    assert math.isclose(float(out.sums["token_loss"]), float(out.loss_sum.detach()), abs_tol=1e-7)
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


@pytest.mark.parametrize(
    "T", [0.0, 0.7, torch.tensor([0.0, 0.5, 1.0, 0.7, 0.0, 2.0], dtype=torch.float64).view(6, 1, 1)]
)
def test_gather_logprobs_is_the_entropy_variant_without_the_entropy(T: float | torch.Tensor) -> None:
    """The proximal and reference log-probs (no entropy pass) are the values the loss's own
    log-probs take, bit for bit, and refuse a negative temperature alike."""
    from nodes.trainer.loss import gather_logprobs

    logits, labels, *_ = _inputs()
    want, _ = gather_logprobs_entropy(logits, labels, T)
    assert torch.equal(gather_logprobs(logits, labels, T), want)
    assert torch.equal(
        gather_logprobs(logits.float(), labels, T), gather_logprobs_entropy(logits.float(), labels, T)[0]
    )
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        gather_logprobs(logits, labels, -1.0)


@pytest.mark.parametrize(("coef", "reward_coef"), [(1.0, 0.0), (0.7, 0.5)])
def test_distillation_loss_and_gradient_match_hand_written(coef: float, reward_coef: float) -> None:
    """On-policy distillation: the advantage of token t is ``reward_coef * A + coef * (log
    pi_teacher(t) - log pi_prox(t))``, under the same clip and behaviour weight as the reward's;
    the loss and its gradient equal the hand-written objective fed that per-token advantage, and
    the reported reverse KL is ``log pi_prox - log pi_teacher`` per loss token."""
    from nodes.trainer.config import DistillConfig
    from nodes.trainer.loss import distill_advantages

    logits, labels, prox, behave, _, adv, mask = _inputs(seed=5)
    g = torch.Generator().manual_seed(9)
    teacher = prox + 0.6 * torch.randn(prox.shape, generator=g, dtype=torch.float64)
    cfg = LossConfig(eps_clip=0.2, behav_imp_weight_cap=2.0, fn_args=MC(tis_cap=1.5))
    dcfg = DistillConfig(teacher="teacher", coef=coef, reward_coef=reward_coef)
    logp, _ = gather_logprobs_entropy(logits, labels)
    advantages, reverse_kl = distill_advantages(adv * mask, teacher, prox, mask, dcfg)
    out = decoupled_ppo_loss(logp, prox, behave, advantages, mask, cfg)
    loss = out.loss_sum / out.n_tokens
    (grad,) = torch.autograd.grad(loss, logits)

    by_hand = torch.zeros_like(adv)
    for b in range(adv.shape[0]):
        for t in range(adv.shape[1]):
            if mask[b, t]:
                by_hand[b, t] = reward_coef * adv[b, t] + coef * (teacher[b, t] - prox[b, t])
    ref_loss = _reference_loss(logits, labels, prox, behave, by_hand, mask, cfg, 1.0)
    (ref_grad,) = torch.autograd.grad(ref_loss, logits)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)
    assert grad.abs().sum() > 0 and torch.all(grad[~mask] == 0)
    assert torch.equal(advantages[~mask], torch.zeros_like(advantages[~mask]))
    torch.testing.assert_close(reverse_kl[mask], (prox - teacher)[mask])


def test_distillation_toward_a_teacher_raises_the_teachers_likelier_tokens() -> None:
    """Pure distillation (``reward_coef = 0``), on-policy: one gradient step raises the log-prob of
    the sampled tokens the teacher likes more than the policy does and lowers the others; with
    the teacher equal to the policy the distillation advantage is exactly 0."""
    from nodes.trainer.config import DistillConfig
    from nodes.trainer.loss import distill_advantages

    logits = torch.zeros(1, 2, 3, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([[0, 1]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    logp, _ = gather_logprobs_entropy(logits, labels)
    prox = logp.detach()
    teacher = prox + torch.tensor([[1.0, -1.0]], dtype=torch.float64)  # likes token 0, dislikes token 1
    dcfg = DistillConfig(teacher="teacher", coef=1.0, reward_coef=0.0)
    adv, _ = distill_advantages(torch.zeros_like(prox), teacher, prox, mask, dcfg)
    out = decoupled_ppo_loss(logp, prox, prox, adv, mask, LossConfig())
    (grad,) = torch.autograd.grad(out.loss_sum, logits)
    assert grad[0, 0, 0] < 0 and grad[0, 1, 1] > 0  # descent raises token 0's logit, lowers token 1's
    same, kl = distill_advantages(torch.zeros_like(prox), prox, prox, mask, dcfg)
    assert torch.equal(same, torch.zeros_like(same)) and torch.equal(kl, torch.zeros_like(kl))
