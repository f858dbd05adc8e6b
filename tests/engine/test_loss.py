"""Losses: hand-written formulas, invariance to how responses are batched, advantage estimators."""

import math

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
        assert abs(float(sum(parts)) - float(whole.detach())) < 1e-12


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
    with pytest.raises(ValueError, match="token_normalizer is the denominator of dapo"):
        make_loss_config("grpo", token_normalizer=10)
    for bad in (0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="token_normalizer"):
            make_loss_config("dapo", token_normalizer=bad)
        with pytest.raises(ValueError, match="loss_scale"):
            make_loss_config("grpo", loss_scale=bad)
    with pytest.raises(TypeError, match="kl_ratio"):
        make_loss_config("grpo", kl_ratio=1)


# The losses and options that reproduce TRL's loss types (luspo, cispo, sapo, vespo, the sequence-level ratio with
# any loss, two-sided clipping), each restated token by token from the module docstring of engine/loss.py.

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
    "luspo": dict(loss="luspo", epsilon_low=0.1, epsilon_high=0.15),
    "luspo-token": dict(loss="luspo", sequence_ratio=False, epsilon_low=0.1, epsilon_high=0.15),
    "cispo": dict(loss="cispo"),
    "cispo-cap-1.1": dict(loss="cispo", epsilon_high=1.1),
    "cispo-sequence": dict(loss="cispo", epsilon_high=1.05, sequence_ratio=True, token_normalizer=30.0),
    "sapo": dict(loss="sapo"),
    "sapo-sequence": dict(loss="sapo", sequence_ratio=True, sapo_temperature_pos=2.0, sapo_temperature_neg=0.5),
    "vespo": dict(loss="vespo"),
    "vespo-shape": dict(loss="vespo", vespo_k_pos=1.5, vespo_lambda_pos=0.5, vespo_k_neg=-1.0, vespo_lambda_neg=0.0,
                        token_normalizer=17.0),
    "dapo-sequence": dict(loss="dapo", sequence_ratio=True, epsilon_low=0.1, epsilon_high=0.15),
    "dr_grpo-sequence": dict(loss="dr_grpo", sequence_ratio=True, epsilon_low=0.1, max_tokens=9),
    "grpo-delta": dict(loss="grpo", delta=1.1, epsilon_low=0.1, epsilon_high=0.05),
    "dapo-delta-sequence": dict(loss="dapo", delta=1.05, sequence_ratio=True, epsilon_low=0.01, epsilon_high=0.01),
    "gspo-delta": dict(loss="gspo", delta=1.02, epsilon_low=0.01, epsilon_high=0.01, loss_scale=0.5),
    "luspo-delta": dict(loss="luspo", delta=1.02, epsilon_low=0.01, epsilon_high=0.01),
}


@pytest.mark.parametrize("case", list(OPTION_CASES))
@pytest.mark.parametrize("beta,kl_ratio", [(0.0, False), (0.04, True)], ids=["no-kl", "kl-ratio"])
def test_trl_losses_match_restatement_and_split_into_batches(case, beta, kl_ratio):
    """Value and gradient against the token-by-token restatement (off-policy ratios e^{±0.3}, clipping, caps and
    gates active), and the group loss split into response batches sums to the whole."""
    logp, mask, old, ref, adv = _data(5)
    cfg = make_loss_config(beta=beta, kl_ratio=kl_ratio, **OPTION_CASES[case])
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
        cfg = make_loss_config(**opts)
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
    cfg = make_loss_config("vespo", vespo_k_pos=-1.0, vespo_lambda_pos=0.5)
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
        cfg = make_loss_config(kind, **options)
        x = logp.clone().requires_grad_(True)
        return torch.autograd.grad(response_loss(x, mask, adv, GroupTotals.of(LENGTHS, cfg), cfg), x)[0]

    token_mean = -(adv[:, None] / sum(LENGTHS)) * mask
    assert torch.allclose(grad("cispo"), token_mean, rtol=0, atol=1e-15)
    assert torch.allclose(grad("vespo"), token_mean, rtol=0, atol=1e-15)
    assert torch.allclose(grad("cispo", epsilon_high=0.5), 0.5 * token_mean, rtol=0, atol=1e-15)
    assert torch.allclose(grad("sapo"), -(adv[:, None] / n / len(LENGTHS)) * mask, rtol=0, atol=1e-15)
    assert torch.allclose(grad("sapo"), grad("grpo"), rtol=0, atol=1e-15)


def test_new_options_are_refused_where_they_do_not_apply():
    assert make_loss_config("luspo").sequence_ratio and make_loss_config("gspo").sequence_ratio
    assert not make_loss_config("dapo").sequence_ratio
    assert make_loss_config("cispo").epsilon_high == 5.0
    with pytest.raises(ValueError, match="gspo is grpo with the sequence ratio"):
        make_loss_config("gspo", sequence_ratio=False)
    with pytest.raises(TypeError, match="sequence_ratio"):
        make_loss_config("grpo", sequence_ratio=1)
    with pytest.raises(ValueError, match="delta bounds the unclipped ratio"):
        make_loss_config("sapo", delta=1.5)
    for bad in (0.0, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match="delta must be"):
            make_loss_config("grpo", delta=bad)
    with pytest.raises(ValueError, match="caps its importance weight from above only"):
        make_loss_config("cispo", epsilon_low=0.2)
    with pytest.raises(ValueError, match="weight cap"):
        make_loss_config("cispo", epsilon_high=0.0)
    for kind in ("sapo", "vespo"):
        with pytest.raises(ValueError, match="has no clip widths"):
            make_loss_config(kind, epsilon=0.2)
    with pytest.raises(ValueError, match="sapo_temperature_pos is a parameter of the sapo loss"):
        make_loss_config("grpo", sapo_temperature_pos=1.0)
    with pytest.raises(ValueError, match="vespo_lambda_neg is a parameter of the vespo loss"):
        make_loss_config("dapo", vespo_lambda_neg=1.0)
    with pytest.raises(ValueError, match="sapo_temperature_neg must be a finite number > 0"):
        make_loss_config("sapo", sapo_temperature_neg=0.0)
    with pytest.raises(ValueError, match="vespo_k_pos must be a finite number"):
        make_loss_config("vespo", vespo_k_pos=float("nan"))
    with pytest.raises(ValueError, match="token_normalizer is the denominator"):
        make_loss_config("luspo", token_normalizer=10.0)
    assert make_loss_config("cispo", token_normalizer=10.0).token_normalizer == 10.0
