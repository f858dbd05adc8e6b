"""Losses: hand-written formulas, invariance to how responses are batched, advantage estimators."""

import pytest
import torch

from longstraw.engine.loss import GroupTotals, compute_advantages, k3_kl, make_loss_config, response_loss

LENGTHS = [3, 5, 2, 4]


def _data(seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = max(LENGTHS)
    logp = -torch.rand(4, t, generator=gen, dtype=torch.float64) * 3
    mask = torch.zeros(4, t, dtype=torch.bool)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = True
    old = logp + 0.3 * torch.randn(4, t, generator=gen, dtype=torch.float64)
    ref = logp + 0.2 * torch.randn(4, t, generator=gen, dtype=torch.float64)
    adv = torch.randn(4, generator=gen, dtype=torch.float64)
    return logp, mask, old, ref, adv


def _manual(kind, logp, old, ref, adv, beta, low, high):
    """Loop-by-loop transcription of docs/design.md §5, independent of the vectorised code."""
    g = len(LENGTHS)
    total, per_resp = 0.0, []
    for i, n in enumerate(LENGTHS):
        if kind == "gspo":
            s = torch.exp((logp[i, :n] - old[i, :n]).mean())
            term = -torch.minimum(s * adv[i], s.clamp(1 - low, 1 + high) * adv[i])
            if beta:
                term = term + beta * k3_kl(logp[i, :n], ref[i, :n]).mean()
            per_resp.append(term)
            continue
        r = torch.exp(logp[i, :n] - old[i, :n])
        tok = -torch.minimum(r * adv[i], r.clamp(1 - low, 1 + high) * adv[i]) + beta * k3_kl(logp[i, :n], ref[i, :n])
        per_resp.append(tok.sum() / n if kind == "grpo" else tok.sum())
    total = sum(per_resp)
    if kind in ("grpo", "gspo"):
        return total / g
    if kind == "dr_grpo":
        return total / (g * max(LENGTHS))
    return total / sum(LENGTHS)


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "dapo", "gspo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_matches_formula_and_is_batching_invariant(kind, beta):
    logp, mask, old, ref, adv = _data()
    cfg = make_loss_config(kind, beta=beta, epsilon_low=0.1, epsilon_high=0.15)
    totals = GroupTotals.of(LENGTHS, cfg)
    whole = response_loss(logp, mask, adv, totals, cfg, old, ref)
    expected = _manual(kind, logp, old, ref, adv, beta, 0.1, 0.15)
    assert abs(float(whole) - float(expected)) < 1e-12
    for split in ([[0], [1], [2], [3]], [[0, 1, 2], [3]], [[1, 3], [0, 2]]):
        parts = []
        for idx in split:
            t = max(LENGTHS[i] for i in idx)  # each micro-batch is padded only to its own longest response
            parts.append(response_loss(logp[idx, :t], mask[idx, :t], adv[idx], totals, cfg, old[idx, :t], ref[idx, :t]))
        assert abs(float(sum(parts)) - float(whole)) < 1e-12


def test_on_policy_ratio_has_logp_gradient():
    logp, mask, _, _, adv = _data()
    logp.requires_grad_(True)
    cfg = make_loss_config("grpo")
    loss = response_loss(logp, mask, adv, GroupTotals.of(LENGTHS, cfg), cfg)
    (grad,) = torch.autograd.grad(loss, logp)
    expected = -(adv[:, None] / torch.tensor(LENGTHS, dtype=torch.float64)[:, None] / 4) * mask
    assert torch.allclose(grad, expected, atol=1e-14)
    assert abs(float(loss.detach()) + float(adv.sum()) / 4) < 1e-12  # rho = 1 on-policy: L = -mean(A)


def test_clipping_zeroes_gradient_outside_the_trust_region():
    logp = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.0, 0.0]], dtype=torch.float64)  # ratio e^1 (clipped for A > 0) and 1
    mask = torch.ones(1, 2, dtype=torch.bool)
    cfg = make_loss_config("dapo")
    loss = response_loss(logp, mask, torch.tensor([1.0], dtype=torch.float64), GroupTotals.of([2], cfg), cfg, old)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[0, 0] == 0 and grad[0, 1] < 0


@pytest.mark.parametrize("kind", ["grpo", "gspo"])
def test_kl_term_without_reference_logprobs_is_refused(kind):
    logp, mask, _, _, adv = _data()
    cfg = make_loss_config(kind, beta=0.04)
    with pytest.raises(ValueError, match="ref_logp"):
        response_loss(logp, mask, adv, GroupTotals.of(LENGTHS, cfg), cfg)


def test_defaults_and_bad_options():
    assert (make_loss_config("dapo").epsilon_low, make_loss_config("dapo").epsilon_high) == (0.2, 0.28)
    assert make_loss_config("grpo", epsilon=0.1).epsilon_high == 0.1
    with pytest.raises(ValueError, match="unknown loss"):
        make_loss_config("ppo2")
    with pytest.raises(ValueError, match="epsilon_low"):
        make_loss_config("grpo", epsilon_low=1.5)
    with pytest.raises(ValueError, match="beta"):
        make_loss_config("grpo", beta=float("nan"))
    with pytest.raises(TypeError):
        make_loss_config("grpo", gamma=1.0)
    with pytest.raises(ValueError, match="max_tokens"):
        GroupTotals.of([3, 9], make_loss_config("dr_grpo", max_tokens=4))


def test_advantages():
    r = torch.tensor([1.0, 0.0, 0.5, 0.5], dtype=torch.float64)
    centered = r - 0.5
    assert torch.allclose(compute_advantages(r, "mean_centered"), centered)
    assert torch.allclose(compute_advantages(r, "grpo", eps=0.0), centered / r.std())
    rloo = torch.stack([r[i] - torch.cat([r[:i], r[i + 1:]]).mean() for i in range(4)])
    assert torch.allclose(compute_advantages(r, "rloo"), rloo)
    with pytest.raises(ValueError, match="NaN"):
        compute_advantages(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="at least 2"):
        compute_advantages(torch.tensor([1.0]), "grpo")
    with pytest.raises(ValueError, match="unknown advantage"):
        compute_advantages(r, "gae")


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "dapo", "gspo"])
def test_zero_advantages_give_exactly_zero_gradient_unless_beta(kind):
    """What lets backward_group skip a zero-advantage group: with every A = 0 and beta = 0 the loss and its
    gradient are exactly zero for every loss (ratios off-policy, clipped or not); with beta > 0 the KL term
    still has a gradient, so such a group must not be skipped."""
    logp, mask, old, ref, _ = _data(seed=3)
    old = old - 0.5  # ratios well above 1 + epsilon_high for some tokens: clipping active too
    zero = torch.zeros(len(LENGTHS), dtype=torch.float64)
    totals = GroupTotals.of(LENGTHS, make_loss_config(kind))
    for old_logp in (None, old):
        x = logp.clone().requires_grad_(True)
        loss = response_loss(x, mask, zero, totals, make_loss_config(kind), old_logp=old_logp, ref_logp=ref)
        loss.backward()
        assert float(loss.detach()) == 0.0 and torch.count_nonzero(x.grad) == 0
    x = logp.clone().requires_grad_(True)
    response_loss(x, mask, zero, totals, make_loss_config(kind, beta=0.04), old_logp=old, ref_logp=ref).backward()
    assert torch.count_nonzero(x.grad[mask]) == int(mask.sum())


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "dapo", "gspo"])
def test_kl_ratio_multiplies_the_k3_term_by_the_ratio(kind):
    """kl_ratio (TRL's use_bias_correction_kl): beta * k3 * rho per token (* s_i for gspo); on-policy its value is
    the plain k3 term's while its gradient is not."""
    logp, mask, old, ref, adv = _data(3)
    logp.requires_grad_(True)
    beta = 0.1
    with_ratio = make_loss_config(kind, beta=beta, kl_ratio=True)
    totals = GroupTotals.of(LENGTHS, with_ratio)
    got = response_loss(logp, mask, adv, totals, with_ratio, old, ref)
    policy = response_loss(logp, mask, adv, totals, make_loss_config(kind), old, ref)
    kl_terms = []
    for i, n in enumerate(LENGTHS):
        k3 = k3_kl(logp[i, :n], ref[i, :n])
        if kind == "gspo":
            kl_terms.append(k3.mean() * torch.exp((logp[i, :n] - old[i, :n]).mean()))
        else:
            kl_terms.append((k3 * torch.exp(logp[i, :n] - old[i, :n])).sum() / {
                "grpo": n * len(LENGTHS), "dr_grpo": len(LENGTHS) * max(LENGTHS), "dapo": sum(LENGTHS)}[kind])
    expected = policy + beta * sum(kl_terms) / (len(LENGTHS) if kind == "gspo" else 1)
    assert abs(float((got - expected).detach())) < 1e-12
    # On-policy (old = None): same value as without kl_ratio, different gradient.
    on = response_loss(logp, mask, adv, totals, with_ratio, None, ref)
    plain = make_loss_config(kind, beta=beta)
    off = response_loss(logp, mask, adv, GroupTotals.of(LENGTHS, plain), plain, None, ref)
    assert abs(float((on - off).detach())) < 1e-12
    g_on, = torch.autograd.grad(on, logp)
    g_off, = torch.autograd.grad(off, logp)
    assert (g_on - g_off).abs().max() > 1e-4


def test_token_normalizer_and_loss_scale():
    """dapo's denominator can be set (TRL: the whole generation batch's tokens); loss_scale multiplies any loss."""
    logp, mask, old, ref, adv = _data(4)
    base = make_loss_config("dapo")
    plain = response_loss(logp, mask, adv, GroupTotals.of(LENGTHS, base), base, old, ref)
    cfg = make_loss_config("dapo", token_normalizer=40.0)
    assert GroupTotals.of(LENGTHS, cfg).total_tokens == 40.0
    got = response_loss(logp, mask, adv, GroupTotals.of(LENGTHS, cfg), cfg, old, ref)
    assert abs(float(got - plain * sum(LENGTHS) / 40.0)) < 1e-14
    for kind in ("grpo", "dr_grpo", "gspo"):
        one, scaled = make_loss_config(kind), make_loss_config(kind, loss_scale=0.25)
        a = response_loss(logp, mask, adv, GroupTotals.of(LENGTHS, one), one, old, ref)
        b = response_loss(logp, mask, adv, GroupTotals.of(LENGTHS, scaled), scaled, old, ref)
        assert abs(float(b - 0.25 * a)) < 1e-15
    with pytest.raises(ValueError, match="token_normalizer is dapo's"):
        make_loss_config("grpo", token_normalizer=10)
    for bad in (0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="token_normalizer"):
            make_loss_config("dapo", token_normalizer=bad)
        with pytest.raises(ValueError, match="loss_scale"):
            make_loss_config("grpo", loss_scale=bad)
    with pytest.raises(TypeError, match="kl_ratio"):
        make_loss_config("grpo", kl_ratio=1)
