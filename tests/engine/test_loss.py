"""Losses: hand-written formulas, invariance to how responses are batched, advantage estimators."""

import math
import re

import pytest
import torch

from longstraw.engine.loss.advantages import compute_advantages
from longstraw.engine.loss.config import LossConfig
from longstraw.engine.loss.kinds import LOSS_KINDS
from longstraw.engine.loss.terms import GroupTotals, k3_kl, response_loss

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
    cfg = LossConfig(kind, beta=beta, epsilon_low=0.1, epsilon_high=0.15)
    totals = GroupTotals.of(LENGTHS, cfg)
    whole = response_loss(logp, mask, adv, totals, cfg, old, ref)
    expected = _manual(kind, logp, old, ref, adv, beta, 0.1, 0.15)
    assert abs(float(whole) - float(expected)) < 1e-12
    for split in ([[0], [1], [2], [3]], [[0, 1, 2], [3]], [[1, 3], [0, 2]]):
        parts = []
        for idx in split:
            t = max(LENGTHS[i] for i in idx)  # each micro-batch is padded only to its own longest response
            parts.append(response_loss(logp[idx, :t], mask[idx, :t], adv[idx], totals, cfg, old[idx, :t], ref[idx, :t]))
        assert abs(float(sum(parts)) - float(whole.detach())) < 1e-12


def test_on_policy_ratio_has_logp_gradient():
    logp, mask, _, _, adv = _data()
    logp.requires_grad_(True)
    cfg = LossConfig("grpo")
    loss = response_loss(logp, mask, adv, GroupTotals.of(LENGTHS, cfg), cfg)
    (grad,) = torch.autograd.grad(loss, logp)
    expected = -(adv[:, None] / torch.tensor(LENGTHS, dtype=torch.float64)[:, None] / 4) * mask
    assert torch.allclose(grad, expected, atol=1e-14)
    assert abs(float(loss.detach()) + float(adv.sum()) / 4) < 1e-12  # rho = 1 on-policy: L = -mean(A)


def test_clipping_zeroes_gradient_outside_the_trust_region():
    logp = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.0, 0.0]], dtype=torch.float64)  # ratio e^1 (clipped for A > 0) and 1
    mask = torch.ones(1, 2, dtype=torch.bool)
    cfg = LossConfig("dapo")
    loss = response_loss(logp, mask, torch.tensor([1.0], dtype=torch.float64), GroupTotals.of([2], cfg), cfg, old)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[0, 0] == 0 and grad[0, 1] < 0


@pytest.mark.parametrize("kind", ["grpo", "gspo"])
def test_kl_term_without_reference_logprobs_is_refused(kind):
    logp, mask, _, _, adv = _data()
    cfg = LossConfig(kind, beta=0.04)
    with pytest.raises(ValueError, match="ref_logp"):
        response_loss(logp, mask, adv, GroupTotals.of(LENGTHS, cfg), cfg)


def test_defaults_and_bad_options():
    assert (LossConfig("dapo").epsilon_low, LossConfig("dapo").epsilon_high) == (0.2, 0.28)
    assert LossConfig("grpo", epsilon=0.1).epsilon_high == 0.1
    with pytest.raises(ValueError, match="unknown loss"):
        LossConfig("ppo2")
    with pytest.raises(ValueError, match="epsilon_low"):
        LossConfig("grpo", epsilon_low=1.5)
    with pytest.raises(ValueError, match="beta"):
        LossConfig("grpo", beta=float("nan"))
    with pytest.raises(TypeError):
        LossConfig("grpo", gamma=1.0)
    with pytest.raises(ValueError, match="max_tokens"):
        GroupTotals.of([3, 9], LossConfig("dr_grpo", max_tokens=4))


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
    totals = GroupTotals.of(LENGTHS, LossConfig(kind))
    for old_logp in (None, old):
        x = logp.clone().requires_grad_(True)
        loss = response_loss(x, mask, zero, totals, LossConfig(kind), old_logp=old_logp, ref_logp=ref)
        loss.backward()
        assert float(loss.detach()) == 0.0 and torch.count_nonzero(x.grad) == 0
    x = logp.clone().requires_grad_(True)
    response_loss(x, mask, zero, totals, LossConfig(kind, beta=0.04), old_logp=old, ref_logp=ref).backward()
    assert torch.count_nonzero(x.grad[mask]) == int(mask.sum())


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "dapo", "gspo"])
def test_kl_ratio_multiplies_the_k3_term_by_the_ratio(kind):
    """kl_ratio (TRL's use_bias_correction_kl): beta * k3 * rho per token (* s_i for gspo); on-policy its value is
    the plain k3 term's while its gradient is not."""
    logp, mask, old, ref, adv = _data(3)
    logp.requires_grad_(True)
    beta = 0.1
    with_ratio = LossConfig(kind, beta=beta, kl_ratio=True)
    totals = GroupTotals.of(LENGTHS, with_ratio)
    got = response_loss(logp, mask, adv, totals, with_ratio, old, ref)
    policy = response_loss(logp, mask, adv, totals, LossConfig(kind), old, ref)
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
    plain = LossConfig(kind, beta=beta)
    off = response_loss(logp, mask, adv, GroupTotals.of(LENGTHS, plain), plain, None, ref)
    assert abs(float((on - off).detach())) < 1e-12
    g_on, = torch.autograd.grad(on, logp)
    g_off, = torch.autograd.grad(off, logp)
    assert (g_on - g_off).abs().max() > 1e-4


def test_token_normalizer_and_loss_scale():
    """dapo's denominator can be set (TRL: the whole generation batch's tokens); loss_scale multiplies any loss."""
    logp, mask, old, ref, adv = _data(4)
    base = LossConfig("dapo")
    plain = response_loss(logp, mask, adv, GroupTotals.of(LENGTHS, base), base, old, ref)
    cfg = LossConfig("dapo", token_normalizer=40.0)
    assert GroupTotals.of(LENGTHS, cfg).total_tokens == 40.0
    got = response_loss(logp, mask, adv, GroupTotals.of(LENGTHS, cfg), cfg, old, ref)
    assert abs(float(got - plain * sum(LENGTHS) / 40.0)) < 1e-14
    for kind in ("grpo", "dr_grpo", "gspo"):
        one, scaled = LossConfig(kind), LossConfig(kind, loss_scale=0.25)
        a = response_loss(logp, mask, adv, GroupTotals.of(LENGTHS, one), one, old, ref)
        b = response_loss(logp, mask, adv, GroupTotals.of(LENGTHS, scaled), scaled, old, ref)
        assert abs(float(b - 0.25 * a)) < 1e-15
    with pytest.raises(ValueError, match="token_normalizer is the denominator of dapo"):
        LossConfig("grpo", token_normalizer=10)
    for bad in (0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="token_normalizer"):
            LossConfig("dapo", token_normalizer=bad)
        with pytest.raises(ValueError, match="loss_scale"):
            LossConfig("grpo", loss_scale=bad)
    with pytest.raises(TypeError, match="kl_ratio"):
        LossConfig("grpo", kl_ratio=1)


# The losses and options that reproduce TRL's loss types (luspo, cispo, sapo, vespo, the sequence-level ratio with
# any loss, two-sided clipping), each restated token by token from the package docstring of engine/loss/.

def _restated(cfg, logp, old, ref, adv, lengths=LENGTHS):
    """The group loss, one token at a time, from loss.py's definitions (independent of its vectorised code; the
    weights cispo and vespo detach are detached here too, so the gradients can be compared)."""
    clipped = ("grpo", "dr_grpo", "dapo", "gspo", "luspo")
    per_response = []
    for i, n in enumerate(lengths):
        r = [logp[i, t] - old[i, t] for t in range(n)]
        s = torch.exp(sum(r) / n)
        a = adv[i]
        terms = []
        for t in range(n):
            rho = s if cfg.sequence_ratio else torch.exp(r[t])
            if cfg.kind in clipped:
                capped = rho if cfg.delta is None else torch.clamp(rho, max=cfg.delta)
                term = -torch.minimum(capped * a, torch.clamp(rho, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high) * a)
            elif cfg.kind == "cispo":
                term = -torch.clamp(rho, max=cfg.epsilon_high).detach() * a * logp[i, t]
            elif cfg.kind == "sapo":
                tau = cfg.sapo_temperature_pos if a > 0 else cfg.sapo_temperature_neg
                term = -(4 / tau) * torch.sigmoid(tau * (rho - 1)) * a
            elif cfg.kind == "vespo":
                log_w = sum(torch.clamp(x, -20, 20) for x in r).detach().clamp(math.log(1e-8), 20)
                if a >= 0:
                    k, lam = cfg.vespo_k_pos, cfg.vespo_lambda_pos
                else:
                    k, lam = cfg.vespo_k_neg, cfg.vespo_lambda_neg
                lam = max(lam, 1e-4)
                phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
                term = -phi * a * logp[i, t]
            else:
                raise AssertionError(cfg.kind)
            if cfg.beta:
                term = term + cfg.beta * k3_kl(logp[i, t], ref[i, t]) * (rho if cfg.kl_ratio else 1)
            terms.append(term)
        total = sum(terms)
        per_response.append(total / n if cfg.kind in ("grpo", "gspo", "sapo") else total)
    g, loss = len(lengths), sum(per_response)
    if cfg.kind in ("grpo", "gspo", "sapo", "luspo"):
        loss = loss / g
    elif cfg.kind == "dr_grpo":
        loss = loss / (g * (cfg.max_tokens or max(lengths)))
    else:
        loss = loss / (cfg.token_normalizer or sum(lengths))
    return loss * cfg.loss_scale


OPTION_CASES = {
    "luspo": dict(kind="luspo", epsilon_low=0.1, epsilon_high=0.15),
    "luspo-token": dict(kind="luspo", sequence_ratio=False, epsilon_low=0.1, epsilon_high=0.15),
    "cispo": dict(kind="cispo"),
    "cispo-cap-1.1": dict(kind="cispo", epsilon_high=1.1),
    "cispo-sequence": dict(kind="cispo", epsilon_high=1.05, sequence_ratio=True, token_normalizer=30.0),
    "sapo": dict(kind="sapo"),
    "sapo-sequence": dict(kind="sapo", sequence_ratio=True, sapo_temperature_pos=2.0, sapo_temperature_neg=0.5),
    "vespo": dict(kind="vespo"),
    "vespo-shape": dict(kind="vespo", vespo_k_pos=1.5, vespo_lambda_pos=0.5, vespo_k_neg=-1.0, vespo_lambda_neg=0.0,
                        token_normalizer=17.0),
    "dapo-sequence": dict(kind="dapo", sequence_ratio=True, epsilon_low=0.1, epsilon_high=0.15),
    "dr_grpo-sequence": dict(kind="dr_grpo", sequence_ratio=True, epsilon_low=0.1, max_tokens=9),
    "grpo-delta": dict(kind="grpo", delta=1.1, epsilon_low=0.1, epsilon_high=0.05),
    "dapo-delta-sequence": dict(kind="dapo", delta=1.05, sequence_ratio=True, epsilon_low=0.01, epsilon_high=0.01),
    "gspo-delta": dict(kind="gspo", delta=1.02, epsilon_low=0.01, epsilon_high=0.01, loss_scale=0.5),
    "luspo-delta": dict(kind="luspo", delta=1.02, epsilon_low=0.01, epsilon_high=0.01),
}


@pytest.mark.parametrize("case", list(OPTION_CASES))
@pytest.mark.parametrize("beta,kl_ratio", [(0.0, False), (0.04, True)], ids=["no-kl", "kl-ratio"])
def test_trl_losses_match_restatement_and_split_into_batches(case, beta, kl_ratio):
    """Value and gradient against the token-by-token restatement (off-policy ratios e^{±0.3}, clipping, caps and
    gates active), and the group loss split into response batches sums to the whole."""
    logp, mask, old, ref, adv = _data(5)
    cfg = LossConfig(beta=beta, kl_ratio=kl_ratio, **OPTION_CASES[case])
    totals = GroupTotals.of(LENGTHS, cfg)
    x = logp.clone().requires_grad_(True)
    whole = response_loss(x, mask, adv, totals, cfg, old, ref)
    (grad,) = torch.autograd.grad(whole, x)
    y = logp.clone().requires_grad_(True)
    expected = _restated(cfg, y, old, ref, adv)
    (expected_grad,) = torch.autograd.grad(expected, y)
    assert abs(float(whole.detach() - expected.detach())) < 1e-12 * max(1.0, abs(float(expected.detach())))
    assert (grad - expected_grad).abs().max() < 1e-12 and expected_grad.abs().max() > 1e-3
    for split in ([[0], [1], [2], [3]], [[0, 1, 2], [3]], [[1, 3], [0, 2]]):
        parts = []
        for idx in split:
            t = max(LENGTHS[i] for i in idx)
            parts.append(response_loss(logp[idx, :t], mask[idx, :t], adv[idx], totals, cfg, old[idx, :t], ref[idx, :t]))
        assert abs(float(sum(parts)) - float(whole.detach())) < 1e-12


@pytest.mark.parametrize("case,dropped", [
    ("luspo-token", ["sequence_ratio"]), ("cispo-cap-1.1", ["epsilon_high"]), ("cispo-sequence", ["sequence_ratio"]),
    ("sapo-sequence", ["sequence_ratio"]), ("sapo-sequence", ["sapo_temperature_pos", "sapo_temperature_neg"]),
    ("vespo-shape", ["vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"]),
    ("dapo-sequence", ["sequence_ratio"]), ("dr_grpo-sequence", ["sequence_ratio"]), ("grpo-delta", ["delta"]),
    ("dapo-delta-sequence", ["delta"]), ("gspo-delta", ["delta"]), ("luspo-delta", ["delta"]),
])
def test_each_option_changes_the_gradient_on_this_data(case, dropped):
    """What the restatement test covers is live on its data: without the case's option (delta, the ratio's level,
    cispo's cap, sapo's and vespo's shapes) the gradient is another one."""
    logp, mask, old, ref, adv = _data(5)
    options = OPTION_CASES[case]
    grads = []
    for opts in (options, {k: v for k, v in options.items() if k not in dropped}):
        cfg = LossConfig(**opts)
        x = logp.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(response_loss(x, mask, adv, GroupTotals.of(LENGTHS, cfg), cfg, old, ref), x)
        grads.append(g)
    assert (grads[0] - grads[1]).abs().max() > 1e-4


def test_vespo_clamps_of_the_log_ratio():
    """vespo's per-token clamp to ±20 and the sum's floor at ln 1e-8 (TRL's, from the reference implementation),
    on ratios that reach them: response 0 has a token at r = +25 (clamped to 20, so its sum is -4 instead of +1),
    response 1 sums to -30 (floored at ln 1e-8), which a negative k makes visible."""
    logp, mask, old, ref, adv = _data(6)
    adv = adv.abs() + 0.1  # the positive-advantage shape for all
    old = logp.clone()
    old[0, :3] = logp[0, :3] - torch.tensor([25.0, -12.0, -12.0], dtype=torch.float64)
    old[1, :5] = logp[1, :5] + 6.0
    cfg = LossConfig("vespo", vespo_k_pos=-1.0, vespo_lambda_pos=0.5)
    x = logp.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(response_loss(x, mask, adv, GroupTotals.of(LENGTHS, cfg), cfg, old), x)
    y = logp.clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(_restated(cfg, y, old, ref, adv), y)
    assert torch.allclose(grad, expected, rtol=1e-12, atol=0)
    # without the clamps response 0 would weigh exp(0.5 - 1 - 0.5 e^1) and response 1 exp(0.5 + 30 - 0.5 e^-30)
    unclamped = [math.exp(0.5 - 1 - 0.5 * math.e), math.exp(0.5 + 30 - 0.5 * math.exp(-30))]
    for i, phi in enumerate(unclamped):
        assert abs(float(grad[i, 0]) + phi * float(adv[i]) / sum(LENGTHS)) > 1e-3 * abs(float(grad[i, 0]))


def test_on_policy_cispo_vespo_sapo_give_the_plain_policy_gradient():
    """On-policy (ratio 1): cispo with a cap >= 1 and vespo (φ(1) = 1) weigh every token's ∇logp by -A_i/Σ|o_i|
    (their token-normalised form); sapo's gate has slope 1 at ratio 1, so its gradient is grpo's."""
    logp, mask, _, _, adv = _data(7)
    n = torch.tensor(LENGTHS, dtype=torch.float64)[:, None]

    def grad(kind, **options):
        cfg = LossConfig(kind, **options)
        x = logp.clone().requires_grad_(True)
        return torch.autograd.grad(response_loss(x, mask, adv, GroupTotals.of(LENGTHS, cfg), cfg), x)[0]

    token_mean = -(adv[:, None] / sum(LENGTHS)) * mask
    assert torch.allclose(grad("cispo"), token_mean, rtol=0, atol=1e-15)
    assert torch.allclose(grad("vespo"), token_mean, rtol=0, atol=1e-15)
    assert torch.allclose(grad("cispo", epsilon_high=0.5), 0.5 * token_mean, rtol=0, atol=1e-15)
    assert torch.allclose(grad("sapo"), -(adv[:, None] / n / len(LENGTHS)) * mask, rtol=0, atol=1e-15)
    assert torch.allclose(grad("sapo"), grad("grpo"), rtol=0, atol=1e-15)


def test_new_options_are_refused_where_they_do_not_apply():
    assert LossConfig("luspo").sequence_ratio and LossConfig("gspo").sequence_ratio
    assert not LossConfig("dapo").sequence_ratio
    assert LossConfig("cispo").epsilon_high == 5.0
    with pytest.raises(ValueError, match="gspo is grpo with the sequence ratio"):
        LossConfig("gspo", sequence_ratio=False)
    with pytest.raises(TypeError, match="sequence_ratio"):
        LossConfig("grpo", sequence_ratio=1)
    with pytest.raises(ValueError, match="delta bounds the unclipped ratio"):
        LossConfig("sapo", delta=1.5)
    for bad in (0.0, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match="delta must be"):
            LossConfig("grpo", delta=bad)
    with pytest.raises(ValueError, match="caps its importance weight from above only"):
        LossConfig("cispo", epsilon_low=0.1)
    with pytest.raises(ValueError, match="weight cap"):
        LossConfig("cispo", epsilon_high=0.0)
    for kind in ("sapo", "vespo"):
        with pytest.raises(ValueError, match="has no clip widths"):
            LossConfig(kind, epsilon=0.2)
    with pytest.raises(ValueError, match="sapo_temperature_pos is a parameter of the sapo loss"):
        LossConfig("grpo", sapo_temperature_pos=2.0)
    with pytest.raises(ValueError, match="vespo_lambda_neg is a parameter of the vespo loss"):
        LossConfig("dapo", vespo_lambda_neg=1.0)
    with pytest.raises(ValueError, match="sapo_temperature_neg must be a finite number > 0"):
        LossConfig("sapo", sapo_temperature_neg=0.0)
    with pytest.raises(ValueError, match="vespo_k_pos must be a finite number"):
        LossConfig("vespo", vespo_k_pos=float("nan"))
    with pytest.raises(ValueError, match="token_normalizer is the denominator"):
        LossConfig("luspo", token_normalizer=10.0)
    assert LossConfig("cispo", token_normalizer=10.0).token_normalizer == 10.0


# verl's clamps (log_ratio_clamp, kl_clamp), against plain per-token formulas written with Python floats.

def _verl_k3(x: float, d: float = 20.0, c: float = 10.0) -> tuple[float, float]:
    """verl's low_var_kl of x = ref - logp: clamp x to ±d, k3 = e^x - x - 1, clamp to ±c; with its derivative in
    logp (torch.clamp passes no gradient outside its bounds)."""
    xc = max(-d, min(d, x))
    k3 = math.exp(xc) - xc - 1.0
    if abs(x) > d or abs(k3) > c:
        return max(-c, min(c, k3)), 0.0
    return k3, -(math.exp(x) - 1.0)


def test_kl_clamp_value_and_gradient_are_verls_low_var_kl():
    """ref - logp from -800 to +800 nats, both clamps reached (k3 = 10 from 2.6 nats up and from -11 down): each
    token's KL term and its gradient equal the plain formula. Unclamped, a 3.3-nat gap has a gradient of 1 - e^3.3
    instead of 0, and 800 nats overflow exp (a NaN gradient)."""
    gaps = [-800.0, -25.0, -11.5, -10.0, -1.0, 0.0, 0.5, 2.0, 2.55, 2.7, 3.3, 10.0, 15.0, 25.0, 800.0]
    n = len(gaps)
    logp = -torch.linspace(0.5, 6.0, n, dtype=torch.float64)[None]
    ref = logp + torch.tensor(gaps, dtype=torch.float64)[None]
    mask = torch.ones(1, n, dtype=torch.bool)
    zero = torch.zeros(1, dtype=torch.float64)  # no policy term: the loss is the KL term alone
    beta = 0.5
    cfg = LossConfig("dapo", beta=beta, kl_clamp=(20.0, 10.0))
    x = logp.clone().requires_grad_(True)
    loss = response_loss(x, mask, zero, GroupTotals.of([n], cfg), cfg, None, ref)
    (grad,) = torch.autograd.grad(loss, x)
    values, slopes = zip(*(_verl_k3(g) for g in gaps))
    assert abs(float(loss.detach()) - beta * sum(values) / n) < 1e-12 * abs(float(loss.detach()))
    expected = torch.tensor(slopes, dtype=torch.float64)[None] * beta / n
    assert torch.allclose(grad, expected, rtol=1e-12, atol=1e-15)
    assert (grad[0, gaps.index(2.55)] != 0) and grad[0, gaps.index(2.7)] == 0 and grad[0, gaps.index(-11.5)] == 0
    k3 = k3_kl(logp, ref, (20.0, 10.0))
    assert float(k3.max()) == 10.0 and bool(torch.isfinite(k3).all())
    plain = LossConfig("dapo", beta=beta)
    y = logp.clone().requires_grad_(True)
    (unclamped,) = torch.autograd.grad(response_loss(y, mask, zero, GroupTotals.of([n], plain), plain, None, ref), y)
    at = gaps.index(3.3)
    assert abs(float(unclamped[0, at]) - beta / n * (1 - math.exp(3.3))) < 1e-12
    assert not bool(torch.isfinite(unclamped).all())


def _clipped_slope(r: float, a: float, low: float, high: float, clamp: tuple[float, float]) -> tuple[float, float]:
    """The clipped per-token term -min(ρA, clip(ρ)A), ρ = e^clamp(r), and its derivative in logp, by hand."""
    rho = math.exp(max(clamp[0], min(clamp[1], r)))
    clipped = max(1 - low, min(1 + high, rho))
    value = -min(rho * a, clipped * a)
    if not clamp[0] <= r <= clamp[1]:
        return value, 0.0
    if 1 - low <= rho <= 1 + high or rho * a < clipped * a:
        return value, -a * rho
    return value, 0.0


@pytest.mark.parametrize("clamp", [(-20.0, 20.0), (-2.0, 2.0)])
def test_log_ratio_clamp_value_and_gradient(clamp):
    """grpo with per-token ratios exp(clamp(r)): log-ratios inside, at and beyond the bounds, with both signs of A;
    value and gradient equal the plain formula. Unclamped, r = 800 overflows exp (a NaN gradient), and with the
    narrow bounds r = -3 (A > 0) keeps a gradient the clamp removes."""
    r = torch.tensor([[0.1, -3.0, 25.0, 800.0, -0.05], [0.15, -3.0, 25.0, 1.5, -25.0]], dtype=torch.float64)
    adv = torch.tensor([0.7, -1.3], dtype=torch.float64)
    logp = -torch.rand(2, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64) - 1.0
    old, mask = logp - r, torch.ones(2, 5, dtype=torch.bool)
    cfg = LossConfig("grpo", epsilon_low=0.2, epsilon_high=0.28, log_ratio_clamp=clamp)
    x = logp.clone().requires_grad_(True)
    loss = response_loss(x, mask, adv, GroupTotals.of([5, 5], cfg), cfg, old)
    (grad,) = torch.autograd.grad(loss, x)
    by_hand = [[_clipped_slope(float(r[i, t]), float(adv[i]), 0.2, 0.28, clamp) for t in range(5)] for i in range(2)]
    value = sum(v for row in by_hand for v, _ in row) / 5 / 2
    assert abs(float(loss.detach()) - value) < 1e-12 * max(1.0, abs(value))
    expected = torch.tensor([[s for _, s in row] for row in by_hand], dtype=torch.float64) / 5 / 2
    assert torch.allclose(grad, expected, rtol=1e-12, atol=1e-15)
    plain = LossConfig("grpo", epsilon_low=0.2, epsilon_high=0.28)
    y = logp.clone().requires_grad_(True)
    (unclamped,) = torch.autograd.grad(response_loss(y, mask, adv, GroupTotals.of([5, 5], plain), plain, old), y)
    assert torch.isnan(unclamped[0, 3]) and bool(torch.isfinite(grad).all())
    if clamp == (-2.0, 2.0):
        assert grad[0, 1] == 0 and float(unclamped[0, 1]) == pytest.approx(-0.7 * math.exp(-3.0) / 10, rel=1e-12)


def test_log_ratio_clamp_of_the_sequence_ratio():
    """gspo (verl's: the sequence's mean log-ratio at most 10): a response whose mean is 12 with A < 0 weighs
    e^10 with no gradient (unclamped: e^12 and its gradient); the other response is unchanged."""
    logp = -torch.rand(2, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64) - 1.0
    old = logp.clone()
    old[0] -= 12.0
    old[1] -= torch.tensor([0.01, -0.02, 0.0, 0.005], dtype=torch.float64)
    adv, mask = torch.tensor([-0.8, 0.6], dtype=torch.float64), torch.ones(2, 4, dtype=torch.bool)
    out = {}
    for name, clamp in (("clamped", (-math.inf, 10.0)), ("plain", None)):
        cfg = LossConfig("gspo", log_ratio_clamp=clamp)
        x = logp.clone().requires_grad_(True)
        loss = response_loss(x, mask, adv, GroupTotals.of([4, 4], cfg), cfg, old)
        out[name] = (loss.detach(), torch.autograd.grad(loss, x)[0])
    (loss, grad), (plain_loss, plain_grad) = out["clamped"], out["plain"]
    assert torch.count_nonzero(grad[0]) == 0 and torch.equal(grad[1], plain_grad[1])
    assert float(plain_grad[0].abs().min()) > 1.0  # unclamped: 0.8 e^12 / (4 * 2) per token
    other = float(plain_loss) - 0.8 * math.exp(12.0) / 2
    assert abs(float(loss) - (0.8 * math.exp(10.0) / 2 + other)) < 1e-9


def test_every_plan_applies_the_clamps():
    """The clamps are per-token functions of the loss every plan calls: standard and exact give the same gradient
    with them (a 3-nat reference gap on each response's first token, log-ratios beyond ±0.1), a gradient other
    than the unclamped one; detach equals standard where it is exact (a one-token prompt). standard_batched scores
    the same way as standard (tests/engine/test_api.py)."""
    from helpers import EXACT_F64, assert_close, grads, random_group, rel_err, tiny_model

    from longstraw import Group, backward_group

    model = tiny_model("qwen3")

    def run(group, plan, **options):
        model.zero_grad(set_to_none=True)
        result = backward_group(model, group, plan=plan, loss=LossConfig("dapo", beta=0.1, **options), chunk_size=5)
        return result.loss, grads(model)

    clamps = dict(log_ratio_clamp=(-0.1, 0.1), kl_clamp=(20.0, 10.0))
    for prompt_len, plan in ((17, "exact"), (1, "detach")):
        group = random_group(prompt_len, [3, 4, 2], seed=prompt_len)
        model.zero_grad(set_to_none=True)
        own = backward_group(model, group, plan="standard").logprobs
        gen = torch.Generator().manual_seed(3)
        old = [lp - 0.3 * torch.randn(lp.shape, generator=gen, dtype=lp.dtype) for lp in own]
        ref = [lp + torch.where(torch.arange(lp.numel()) == 0, 3.0, 0.1) for lp in own]
        group = Group(group.prompt, group.responses, group.advantages, old_logprobs=old, ref_logprobs=ref)
        loss, g_standard = run(group, "standard", **clamps)
        plan_loss, g_plan = run(group, plan, **clamps)
        assert_close(f"{plan} P={prompt_len}", g_standard, g_plan, EXACT_F64)
        assert abs(plan_loss - loss) < 1e-12
        if plan == "exact":
            plain_loss, g_plain = run(group, "standard")
            assert rel_err(g_standard, g_plain) > 1e-2 and abs(loss - plain_loss) > 1e-3


def test_bad_clamps_are_refused():
    for bad in ((0.0, 20.0), (-20.0, 0.0), (5.0, 20.0), (float("nan"), 1.0), (1.0,), "20", (True, 2.0)):
        with pytest.raises(ValueError, match="log_ratio_clamp"):
            LossConfig("grpo", log_ratio_clamp=bad)
    for bad in ((0.0, 10.0), (20.0, -1.0), (20.0,), 10.0, (float("nan"), 10.0)):
        with pytest.raises(ValueError, match="kl_clamp"):
            LossConfig("grpo", beta=0.1, kl_clamp=bad)
    assert LossConfig("gspo", log_ratio_clamp=[-math.inf, 10]).log_ratio_clamp == (-math.inf, 10.0)
    assert LossConfig("grpo").log_ratio_clamp is None and LossConfig("grpo").kl_clamp is None


@pytest.mark.parametrize("kind, rewards, why", [
    ("grpo", [1e300, -1e300, 0.0], "their grpo advantages overflow float64 on the way"),  # std inf: silent zeros
    ("grpo", [1e200, 0.0, 0.0], "their grpo advantages overflow float64 on the way"),
    ("rloo", [1e308, 1e308, -1e308], "their rloo advantages overflow float64 on the way"),  # the mean overflows
    ("mean_centered", [1e308, 1e308, 0.0], "their mean_centered advantages overflow float64 on the way"),
])
def test_advantages_refuse_rewards_they_cannot_normalise(kind, rewards, why):
    """Finite rewards whose mean, deviations or standard deviation overflow: one ValueError that names the rewards
    and the fix, never zeros or NaN advantages."""
    from longstraw.engine.loss.advantages import UnnormalisableRewards

    with pytest.raises(UnnormalisableRewards, match=r"rewards are too large to normalise: \[.*\] \(" + re.escape(why)
                       + r"\); scale the reward function's values down"):
        compute_advantages(torch.tensor(rewards, dtype=torch.float64), kind)
    assert issubclass(UnnormalisableRewards, ValueError)
    with pytest.raises(ValueError, match=r"reach 1e\+30, beyond the 1.84e\+19 the loss can hold in float32"):
        compute_advantages(torch.tensor([1e30, 0.0, 0.0], dtype=torch.float64), "rloo", loss_dtype=torch.float32)
    big = compute_advantages(torch.tensor([1e30, 0.0, 0.0], dtype=torch.float64), "rloo")  # float64 holds it
    assert float(big[0]) == pytest.approx(1e30)
    large = compute_advantages(torch.tensor([1e150, 0.0, -1e150], dtype=torch.float64), "grpo")  # std 1e150: fine
    assert float(large.abs().max()) == pytest.approx(1.0)


def test_every_loss_has_one_entry():
    from longstraw.choices import LOSSES
    from longstraw.engine.loss.kinds import LOSS_KINDS

    assert tuple(name for name, entry in LOSS_KINDS.items() if not entry.supervised) == LOSSES
    assert [name for name, entry in LOSS_KINDS.items() if entry.supervised] == ["nll"]


@pytest.mark.parametrize("kind", list(LOSS_KINDS))
def test_a_built_loss_config_is_replaced_like_any_dataclass(kind):
    """The fields hold the values the loss computes with, so `dataclasses.replace` of a built config rebuilds it:
    the unused fields' own values pass the checks, and the changed one is checked again."""
    import dataclasses

    cfg = LossConfig(kind)
    scaled = dataclasses.replace(cfg, loss_scale=0.5)
    assert scaled.loss_scale == 0.5 and dataclasses.replace(scaled, loss_scale=1.0) == cfg
    with pytest.raises(ValueError, match="loss_scale must be"):
        dataclasses.replace(cfg, loss_scale=-1.0)
