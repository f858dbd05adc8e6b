"""GRPO-family losses and advantage estimators, as pure tensor functions.

Every loss here is a sum over responses of a per-response term once the group's constants are fixed
(G, Σ|o_i|, L_max, or a normaliser the caller passes), so a group replayed one response at a time, k at a time, or
all at once gives the same total: `response_loss` returns the batch's share of the group loss, and the shares add
up.

Definitions (docs/design.md §5), with per-token log-probs logp_{i,t}, log-ratio r_{i,t} = logp − old where `old`
defaults to logp.detach() (on-policy: ratio 1 but its gradient is that of logp), and the importance ratio ρ: per
token, ρ_{i,t} = exp(r_{i,t}), or per sequence, s_i = exp((1/|o_i|) Σ_t r_{i,t}) spread over the response's tokens
(gspo and luspo by default; `sequence_ratio` chooses). m_{i,t} = min(ρ A_i, clip(ρ, 1−ε_low, 1+ε_high) A_i):

* ``grpo``:    L = −(1/G) Σ_i (1/|o_i|) Σ_t m_{i,t}
* ``dr_grpo``: L = −(1/(G·L_max)) Σ_i Σ_t m_{i,t}            (L_max = `max_tokens`, default max_i |o_i|)
* ``dapo``:    L = −(1/Σ_i|o_i|) Σ_i Σ_t m_{i,t}              (clip-higher: ε_low 0.2, ε_high 0.28)
* ``gspo``:    grpo with the sequence ratio: L = −(1/G) Σ_i min(s_i A_i, clip(s_i) A_i)
               (ε_low 3e-4, ε_high 4e-4, the GSPO paper's values)
* ``luspo``:   gspo with each response weighted by its length: L = −(1/G) Σ_i |o_i| min(s_i A_i, clip(s_i) A_i),
               i.e. −(1/G) Σ_i Σ_t m_{i,t}; GSPO's clip widths
* ``cispo``:   L = −(1/Σ_i|o_i|) Σ_i Σ_t sg(min(ρ, ε_max)) A_i logp_{i,t}: the importance weight, capped at
               ε_max = `epsilon_high` (the cap itself, not 1 + ε; default 5.0) and detached (sg), times the
               log-prob, so every token keeps a gradient; no lower clip
* ``sapo``:    L = −(1/G) Σ_i (1/|o_i|) Σ_t (4/τ) σ(τ (ρ − 1)) A_i: a sigmoid gate instead of the clip (its slope
               at ρ = 1 is 1, so on-policy it is grpo), τ = `sapo_temperature_pos` (1.0) where A_i > 0, else
               `sapo_temperature_neg` (1.05); no clip widths
* ``vespo``:   L = −(1/Σ_i|o_i|) Σ_i Σ_t φ_i A_i logp_{i,t}, φ_i = sg(e^λ w_i^k e^{−λ w_i}) with w_i the sequence's
               product of token ratios, exp(Σ_t r_{i,t}) (each r_{i,t} clamped to [−20, 20], their sum to
               [ln 1e-8, 20]; a non-finite φ counts 0), and (k, λ) = (`vespo_k_pos`, `vespo_lambda_pos`) = (2, 3)
               where A_i ≥ 0, else (`vespo_k_neg`, `vespo_lambda_neg`) = (3, 2), λ floored at 1e-4; φ(1) = 1;
               no clip widths (the reference implementation's clamps, as TRL has them)

The supervised loss, for a warm start on gold responses (`train/warmup.py`):

* ``nll``:     L = −(1/Σ_i|o_i|) Σ_i Σ_t logp_{i,t}: the mean negative log-likelihood of the loss tokens (|o_i| counts
               a response's loss tokens: observations are masked out), advantages and old log-probs ignored; no
               ratio, clip or KL term (beta, the clip widths and the ratio options are refused). Not one of
               `LOSSES` (the trainer's GRPO losses): `backward_group(..., loss="nll")` and the warm start use it.

With ``beta > 0`` the k3 estimate of KL(π‖π_ref), k3 = exp(ref − logp) − (ref − logp) − 1, is added per token
(times β) with the same normalisation as the policy term.

Options that reproduce other trainers' definitions (TRL's `GRPOTrainer`: `longstraw.integrations.trl` sets them;
docs/trl.md). Each defaults to LongStraw's own definition:

* ``max_tokens``: dr_grpo's L_max (TRL: `max_completion_length`; ours: the group's longest response).
* ``token_normalizer``: the denominator of the token-normalised losses (dapo, cispo, vespo) instead of the group's
  Σ|o_i| (TRL: every completion token of the optimizer step's generation batch, so several groups share one
  denominator; for its bnpo, the micro-batch's tokens).
* ``kl_ratio``: multiply the k3 term by the ratio ρ (token or sequence, as the policy term's) — TRL's
  `use_bias_correction_kl`, its default. Its value is k3 on-policy, its gradient is not: ∇(ρ·k3) = k3·∇ρ + ∇k3.
* ``loss_scale``: the group loss times this factor (TRL averages grpo/dr_grpo/gspo/sapo/luspo over every sequence of
  the optimizer step, N of them: a group of G then weighs G/N).
* ``sequence_ratio``: the ratio's level, True for the sequence's s_i, False for per-token ρ; None is the loss's own
  (sequence for gspo and luspo, token for the others; gspo refuses False: it is grpo). TRL's
  `importance_sampling_level`: with dapo, dr_grpo, cispo or sapo it spreads s_i over the tokens, so a response's
  term is its length times s_i's.
* ``delta``: two-sided clipping (INTELLECT-2) for the clipped losses (grpo, dr_grpo, dapo, gspo, luspo):
  m = min(min(ρ, δ) A, clip(ρ) A), which bounds a negative advantage's term when ρ runs above 1 + ε_high.

Clamps that reproduce verl's numerical-stability clamps (`longstraw.integrations.verl` sets them; docs/verl.md).
Each is a torch.clamp, whose gradient is 0 where the value lies outside the bounds; None (the default) clamps
nothing:

* ``log_ratio_clamp`` = (low, high): the ratio's exponent clamped to [low, high] before the exp, i.e.
  ρ_{i,t} = exp(clamp(r_{i,t})) per token, s_i = exp(clamp((1/|o_i|) Σ_t r_{i,t})) per sequence. low < 0 < high
  (on-policy r = 0 stays 0). verl's policy losses: (−20, 20) per token; its gspo: (−inf, 10) on the sequence's.
* ``kl_clamp`` = (d, c): the k3 term as verl's `kl_penalty` "low_var_kl"/"k3" computes it,
  x = clamp(ref − logp, −d, d), k3 = clamp(exp(x) − x − 1, −c, c); verl's (d, c) = (20, 10). k3 > c from
  ref − logp ≈ 2.6 nats up (for c = 10): there the term and its gradient are constant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from longstraw.choices import ADVANTAGES, LOSSES

# The losses whose policy term is the clipped m_{i,t}, with their default clip widths (ε_low, ε_high).
_DEFAULT_CLIP = {
    "grpo": (0.2, 0.2),
    "dr_grpo": (0.2, 0.2),
    "dapo": (0.2, 0.28),
    "gspo": (3e-4, 4e-4),
    "luspo": (3e-4, 4e-4),
}
_CISPO_CAP = 5.0  # cispo's default ε_max (ScaleRL's recommended value)
_SEQUENCE_RATIO = ("gspo", "luspo")  # the losses whose ratio is the sequence's unless `sequence_ratio` says otherwise
_TOKEN_NORMALISED = ("dapo", "cispo", "vespo", "nll")  # divided by a token count, which `token_normalizer` replaces
SUPERVISED_LOSSES = ("nll",)  # the losses of gold responses: no advantage, ratio or reference
_SAPO_TEMPERATURES = (1.0, 1.05)  # (A > 0, A <= 0), the SAPO paper's
_VESPO_SHAPE = (2.0, 3.0, 3.0, 2.0)  # (k_pos, lambda_pos, k_neg, lambda_neg), the VESPO paper's
_VESPO_MIN_LAMBDA = 1e-4


@dataclass(frozen=True)
class LossConfig:
    """Which loss and its coefficients. Build it with `make_loss_config`, which fills per-loss defaults."""

    kind: str = "grpo"
    epsilon_low: float = 0.2  # lower clip: ratio >= 1 - epsilon_low (unused by cispo, sapo, vespo)
    epsilon_high: float = 0.2  # upper clip: ratio <= 1 + epsilon_high; cispo: the weight's cap ε_max itself
    beta: float = 0.0  # KL coefficient (k3 estimator against ref_logprobs)
    max_tokens: int | None = None  # dr_grpo's L_max; None = longest response in the group
    token_normalizer: float | None = None  # dapo/cispo/vespo's denominator; None = the group's Σ|o_i|
    kl_ratio: bool = False  # k3 times the ratio (TRL's use_bias_correction_kl)
    loss_scale: float = 1.0  # the group loss times this
    sequence_ratio: bool = False  # the ratio is the sequence's s_i (gspo, luspo) rather than per token
    delta: float | None = None  # two-sided clipping of the clipped losses: min(ratio, delta) in the unclipped term
    sapo_temperature_pos: float = _SAPO_TEMPERATURES[0]  # sapo's gate temperature where A > 0
    sapo_temperature_neg: float = _SAPO_TEMPERATURES[1]  # ... and where A <= 0
    vespo_k_pos: float = _VESPO_SHAPE[0]  # vespo's power k where A >= 0
    vespo_lambda_pos: float = _VESPO_SHAPE[1]  # vespo's decay λ where A >= 0
    vespo_k_neg: float = _VESPO_SHAPE[2]  # ... where A < 0
    vespo_lambda_neg: float = _VESPO_SHAPE[3]
    log_ratio_clamp: tuple[float, float] | None = None  # (low, high) on the ratio's exponent; None: unclamped
    kl_clamp: tuple[float, float] | None = None  # (d, c): ref − logp to ±d before the exp, k3 to ±c; None: unclamped


def _finite(name: str, value: object, positive: bool) -> float:
    """`value` as a float, refused unless it is a finite number (> 0 when `positive`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
            positive and value <= 0):
        raise ValueError(f"{name} must be a finite number{' > 0' if positive else ''}, got {value!r}")
    return float(value)


def make_loss_config(
    loss: str = "grpo",
    *,
    epsilon: float | None = None,
    epsilon_low: float | None = None,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    max_tokens: int | None = None,
    token_normalizer: float | None = None,
    kl_ratio: bool = False,
    loss_scale: float = 1.0,
    sequence_ratio: bool | None = None,
    delta: float | None = None,
    sapo_temperature_pos: float | None = None,
    sapo_temperature_neg: float | None = None,
    vespo_k_pos: float | None = None,
    vespo_lambda_pos: float | None = None,
    vespo_k_neg: float | None = None,
    vespo_lambda_neg: float | None = None,
    log_ratio_clamp: tuple[float, float] | None = None,
    kl_clamp: tuple[float, float] | None = None,
) -> LossConfig:
    """Validate loss options. `epsilon` sets both clip sides; `epsilon_low`/`epsilon_high` override one side (cispo
    takes `epsilon_high` only, its weight cap; sapo and vespo have no clip). The sapo_* and vespo_* options belong to
    their loss (None: its default). `max_tokens`, `token_normalizer`, `kl_ratio`, `loss_scale`, `sequence_ratio`,
    `delta`, `log_ratio_clamp`, `kl_clamp`: see the module docstring."""
    if loss not in LOSSES and loss not in SUPERVISED_LOSSES:
        raise ValueError(f"unknown loss {loss!r}: choose one of {', '.join(LOSSES + SUPERVISED_LOSSES)}")
    if loss in _DEFAULT_CLIP:
        low, high = _DEFAULT_CLIP[loss]
        if epsilon is not None:
            low = high = float(epsilon)
        low = float(epsilon_low) if epsilon_low is not None else low
        high = float(epsilon_high) if epsilon_high is not None else high
    elif loss == "cispo":
        if epsilon is not None or epsilon_low is not None:
            raise ValueError("cispo caps its importance weight from above only: set epsilon_high (the cap ε_max "
                             "itself), not epsilon or epsilon_low")
        low, high = LossConfig.epsilon_low, _CISPO_CAP
        if epsilon_high is not None:
            high = _finite("cispo's epsilon_high (the weight cap)", epsilon_high, positive=True)
    elif loss in ("sapo", "vespo"):
        if epsilon is not None or epsilon_low is not None or epsilon_high is not None:
            raise ValueError(f"the {loss} loss has no clip widths (its weight is smooth): leave epsilon, epsilon_low "
                             "and epsilon_high unset")
        low, high = LossConfig.epsilon_low, LossConfig.epsilon_high
    elif loss == "nll":
        policy_only = {"epsilon": epsilon, "epsilon_low": epsilon_low, "epsilon_high": epsilon_high,
                       "log_ratio_clamp": log_ratio_clamp, "kl_clamp": kl_clamp}
        given = [name for name, value in policy_only.items() if value is not None]
        given += [name for name, on in (("beta", beta != 0), ("kl_ratio", kl_ratio is True),
                                        ("sequence_ratio", sequence_ratio is True)) if on]
        if given:
            raise ValueError(f"the nll loss is the mean negative log-likelihood of the loss tokens (no ratio, clip "
                             f"or KL term): leave {', '.join(given)} unset")
        low, high = LossConfig.epsilon_low, LossConfig.epsilon_high
    else:
        raise ValueError(f"unknown loss {loss!r}: choose one of {', '.join(LOSSES)}")
    for name, value in (("epsilon_low", low), ("epsilon_high", high), ("beta", float(beta))):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    if low >= 1:
        raise ValueError(f"epsilon_low must be < 1 (the ratio's lower clip is 1 - epsilon_low), got {low}")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"max_tokens must be a positive int (dr_grpo's L_max), got {max_tokens!r}")
    if token_normalizer is not None:
        if loss not in _TOKEN_NORMALISED:
            raise ValueError(f"token_normalizer is the denominator of {', '.join(_TOKEN_NORMALISED)}; the {loss} loss "
                             "has none (use loss='dapo')")
        if isinstance(token_normalizer, bool) or not isinstance(token_normalizer, (int, float)) or not (
                math.isfinite(token_normalizer) and token_normalizer > 0):
            raise ValueError(f"token_normalizer must be a finite number > 0 (a token count), got {token_normalizer!r}")
    if not isinstance(kl_ratio, bool):
        raise TypeError(f"kl_ratio must be True or False, got {kl_ratio!r}")
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)) or not (
            math.isfinite(loss_scale) and loss_scale > 0):
        raise ValueError(f"loss_scale must be a finite number > 0, got {loss_scale!r}")
    if sequence_ratio is None:
        sequence_ratio = loss in _SEQUENCE_RATIO
    elif not isinstance(sequence_ratio, bool):
        raise TypeError(f"sequence_ratio must be True, False or None, got {sequence_ratio!r}")
    elif loss == "gspo" and not sequence_ratio:
        raise ValueError("gspo is grpo with the sequence ratio: for per-token ratios use loss='grpo'")
    if delta is not None:
        if loss not in _DEFAULT_CLIP:
            raise ValueError(f"delta bounds the unclipped ratio of the clipped losses ({', '.join(_DEFAULT_CLIP)}); "
                             f"the {loss} loss has none")
        delta = _finite("delta", delta, positive=True)
    sapo = _own_parameters(loss, "sapo", _SAPO_TEMPERATURES, positive=True,
                            sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg)
    vespo = _own_parameters(loss, "vespo", _VESPO_SHAPE, positive=False, vespo_k_pos=vespo_k_pos,
                             vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg,
                             vespo_lambda_neg=vespo_lambda_neg)
    return LossConfig(kind=loss, epsilon_low=low, epsilon_high=high, beta=float(beta), max_tokens=max_tokens,
                      token_normalizer=None if token_normalizer is None else float(token_normalizer),
                      kl_ratio=kl_ratio, loss_scale=float(loss_scale), sequence_ratio=sequence_ratio, delta=delta,
                      **sapo, **vespo, log_ratio_clamp=_log_ratio_clamp(log_ratio_clamp),
                      kl_clamp=_kl_clamp(kl_clamp))


def _pair(name: str, value: object, what: str) -> tuple[float, float]:
    """`value` as two floats, refused (naming `what` the pair holds) unless it is a pair of real numbers."""
    if not isinstance(value, (tuple, list)) or len(value) != 2 or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) for v in value):
        raise ValueError(f"{name} must be a pair of numbers {what}, got {value!r}")
    return float(value[0]), float(value[1])


def _log_ratio_clamp(value: object) -> tuple[float, float] | None:
    if value is None:
        return None
    low, high = _pair("log_ratio_clamp", value, "(low, high)")
    if not low < 0 < high:
        raise ValueError(f"log_ratio_clamp=(low, high) must have low < 0 < high (the on-policy log-ratio, 0, must "
                         f"pass unchanged; verl's is (-20, 20)), got {value!r}")
    return low, high


def _kl_clamp(value: object) -> tuple[float, float] | None:
    if value is None:
        return None
    bound, cap = _pair("kl_clamp", value, "(d, c)")
    if not (bound > 0 and cap > 0):
        raise ValueError(f"kl_clamp=(d, c) must have d > 0 and c > 0 (ref - logp clamped to ±d, k3 to ±c; verl's is "
                         f"(20, 10)), got {value!r}")
    return bound, cap


def _own_parameters(loss: str, owner: str, defaults: tuple[float, ...], positive: bool,
                     **given: float | None) -> dict[str, float]:
    """The `owner` loss's own parameters (`given`, None: the default), refused when set for another loss."""
    out = {}
    for (name, value), default in zip(given.items(), defaults):
        if value is None:
            out[name] = default
        elif loss != owner:
            raise ValueError(f"{name} is a parameter of the {owner} loss, not of {loss} (use loss={owner!r})")
        else:
            out[name] = _finite(name, value, positive)
    return out


@dataclass(frozen=True)
class GroupTotals:
    """Group-wide constants the normalisations need, known before any response is replayed."""

    num_responses: int  # G
    total_tokens: float  # Σ_i |o_i|, or the config's token_normalizer
    max_tokens: int  # L_max

    @staticmethod
    def of(lengths: list[int], cfg: LossConfig) -> GroupTotals:
        longest = max(lengths)
        if cfg.max_tokens is not None and cfg.max_tokens < longest:
            raise ValueError(f"max_tokens={cfg.max_tokens} is shorter than the longest response ({longest})")
        total = cfg.token_normalizer if cfg.token_normalizer is not None else sum(lengths)
        return GroupTotals(len(lengths), total, cfg.max_tokens or longest)


def k3_kl(logp: torch.Tensor, ref: torch.Tensor, clamp: tuple[float, float] | None = None) -> torch.Tensor:
    """k3 estimator of KL(π‖π_ref) per token: exp(ref − logp) − (ref − logp) − 1 (≥ 0, unbiased). clamp=(d, c):
    verl's version, ref − logp clamped to ±d before the exp and the result to ±c (the module docstring)."""
    delta = ref - logp
    if clamp is None:
        return torch.exp(delta) - delta - 1.0
    bound, cap = clamp
    delta = torch.clamp(delta, min=-bound, max=bound)
    return torch.clamp(torch.exp(delta) - delta - 1.0, min=-cap, max=cap)


def _kl_to(ref_logp: torch.Tensor | None, logp: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """`k3_kl` against the reference log-probs, which the KL term (beta > 0) needs, with the config's clamp."""
    if ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp (the reference model's log-probs)")
    return k3_kl(logp, ref_logp, cfg.kl_clamp)


def _by_sign(positive: torch.Tensor, if_true: float, if_false: float, like: torch.Tensor) -> torch.Tensor:
    """`if_true` where `positive`, else `if_false`, in `like`'s dtype and device (torch.where of two Python floats
    gives the default dtype, float32, which would round e.g. 1.05 in a float64 loss)."""
    def full(value: float) -> torch.Tensor:
        return torch.tensor(value, dtype=like.dtype, device=like.device)

    return torch.where(positive, full(if_true), full(if_false))


def _vespo_weight(log_ratio: torch.Tensor, adv: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """φ_i per response (B, 1), detached: e^λ w^k e^{−λ w} in log space, w = exp(Σ_t r_{i,t}) with the clamps of the
    module docstring. log_ratio: (B, T), zero on padding."""
    with torch.no_grad():
        log_w = log_ratio.clamp(-20.0, 20.0).sum(-1, keepdim=True).clamp(math.log(1e-8), 20.0)
        nonneg = adv >= 0
        k = _by_sign(nonneg, cfg.vespo_k_pos, cfg.vespo_k_neg, log_w)
        lam = _by_sign(nonneg, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg, log_w).clamp(min=_VESPO_MIN_LAMBDA)
        return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _policy_term(logp: torch.Tensor, log_ratio: torch.Tensor, ratio: torch.Tensor, adv: torch.Tensor,
                 cfg: LossConfig) -> torch.Tensor:
    """The policy part of the per-token loss (before the mask and the normalisation); broadcasts to (B, T).
    ratio: (B, T) per token or (B, 1) per sequence; adv: (B, 1)."""
    if cfg.kind in _DEFAULT_CLIP:
        clipped = ratio.clamp(1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_high)
        unclipped = ratio if cfg.delta is None else ratio.clamp(max=cfg.delta)
        return -torch.minimum(unclipped * adv, clipped * adv)
    elif cfg.kind == "cispo":
        return -ratio.clamp(max=cfg.epsilon_high).detach() * adv * logp
    elif cfg.kind == "sapo":
        tau = _by_sign(adv > 0, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg, ratio)
        return -torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * adv
    elif cfg.kind == "vespo":
        return -_vespo_weight(log_ratio, adv, cfg) * adv * logp
    elif cfg.kind == "nll":
        return -logp
    else:
        raise ValueError(f"unknown loss {cfg.kind!r}: choose one of {', '.join(LOSSES)}")


def response_loss(
    logp: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    totals: GroupTotals,
    cfg: LossConfig,
    old_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
) -> torch.Tensor:
    """This batch's share of the group loss (a scalar); shares of disjoint batches add up to the group loss.

    logp, mask, old_logp, ref_logp: (B, T), right-padded, mask True on real tokens; advantages: (B,).
    """
    per_token = token_terms(logp, mask, advantages, cfg, old_logp, ref_logp)  # (B, T)
    lengths = mask.to(logp.dtype).sum(-1)  # (B,)
    g = totals.num_responses
    if cfg.kind in ("grpo", "gspo", "sapo"):
        loss = (per_token.sum(-1) / lengths).sum() / g
    elif cfg.kind == "dr_grpo":
        loss = per_token.sum() / (g * totals.max_tokens)
    elif cfg.kind in _TOKEN_NORMALISED:
        loss = per_token.sum() / totals.total_tokens
    elif cfg.kind == "luspo":
        loss = per_token.sum() / g
    else:
        raise ValueError(f"unknown loss {cfg.kind!r}: choose one of {', '.join(LOSSES)}")
    return loss * cfg.loss_scale


def token_weight(cfg: LossConfig, totals: GroupTotals, loss_tokens: int) -> float:
    """The factor `response_loss` divides a response's summed per-token terms by, for a response of `loss_tokens`
    loss tokens in a group of `totals`, times the config's loss_scale: the loss is Σ_i weight_i Σ_t term_{i,t}."""
    g = totals.num_responses
    if cfg.kind in ("grpo", "gspo", "sapo"):
        weight = 1.0 / (loss_tokens * g)
    elif cfg.kind == "dr_grpo":
        weight = 1.0 / (g * totals.max_tokens)
    elif cfg.kind in _TOKEN_NORMALISED:
        weight = 1.0 / totals.total_tokens
    elif cfg.kind == "luspo":
        weight = 1.0 / g
    else:
        raise ValueError(f"unknown loss {cfg.kind!r}: choose one of {', '.join(LOSSES)}")
    return weight * cfg.loss_scale


def is_token_level(cfg: LossConfig) -> bool:
    """Whether a token's term depends on its own log-prob only (not on the sequence's other tokens): then the loss of
    a sequence is a sum over any split of its tokens (a prefix tree's nodes). The sequence ratio and vespo's weight
    read the whole sequence."""
    return not cfg.sequence_ratio and cfg.kind != "vespo"


def token_terms(logp: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor, cfg: LossConfig,
                old_logp: torch.Tensor | None = None, ref_logp: torch.Tensor | None = None) -> torch.Tensor:
    """The per-token terms (B, T) of the loss before its normalisation, zero off `mask`: the policy term plus the
    KL term. The sequence ratio and vespo's weight take each row as one whole sequence (its mask's tokens).

    logp, mask, old_logp, ref_logp: (B, T); advantages: (B,)."""
    mask_f = mask.to(logp.dtype)
    lengths = mask_f.sum(-1)  # (B,)
    old = logp.detach() if old_logp is None else old_logp
    log_ratio = (logp - old) * mask_f  # padding contributes 0 (and its logp gets no gradient)
    adv = advantages.to(logp.dtype)[:, None]  # (B, 1)
    clamp = cfg.log_ratio_clamp
    if cfg.sequence_ratio:
        exponent = log_ratio.sum(-1, keepdim=True) / lengths[:, None]
        if clamp is not None:
            exponent = torch.clamp(exponent, min=clamp[0], max=clamp[1])
        ratio = torch.exp(exponent)  # (B, 1): s_i on every token
    else:
        if clamp is not None:  # padding's 0 stays 0 (low < 0 < high)
            log_ratio = torch.clamp(log_ratio, min=clamp[0], max=clamp[1])
        ratio = torch.exp(log_ratio)  # (B, T)
    per_token = _policy_term(logp, log_ratio, ratio, adv, cfg)
    if cfg.beta:
        kl = _kl_to(ref_logp, logp, cfg)
        per_token = per_token + cfg.beta * (kl * ratio if cfg.kl_ratio else kl)
    return per_token * mask_f  # (B, T)


class UnnormalisableRewards(ValueError):
    """Finite rewards whose advantages overflow (`compute_advantages`): the reward function's scale is at fault.
    `describe(subject)` words the message about `subject` (the trainer names the step and group)."""

    def __init__(self, rewards: torch.Tensor, why: str) -> None:
        self.shown = ", ".join(f"{float(r):.3g}" for r in rewards[:8]) + (", ..." if rewards.numel() > 8 else "")
        self.why = why
        super().__init__(self.describe("rewards"))

    def describe(self, subject: str) -> str:
        return (f"{subject} are too large to normalise: [{self.shown}] ({self.why}); scale the reward function's "
                "values down, e.g. to [0, 1]")


def compute_advantages(rewards: torch.Tensor, kind: str = "grpo", eps: float = 1e-4, *,
                       loss_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Advantages of one group from its rewards (G,).

    * ``grpo``: (r − mean) / (std + eps), std unbiased as in TRL; needs G ≥ 2.
    * ``mean_centered``: r − mean (Dr. GRPO).
    * ``rloo``: r_i − mean_{j≠i} r_j = G/(G−1) · (r_i − mean); needs G ≥ 2.

    Finite rewards can still be too large to normalise: the mean, the deviations from it and grpo's standard
    deviation (whose squares overflow float64 once |reward| nears 1e154) must be finite, or the advantages would be
    silently 0 (an infinite std), inf or NaN; those are refused (`UnnormalisableRewards`, a ValueError). With
    `loss_dtype` the advantages must also stay below the square root of its largest value, the bound
    `backward_group` enforces in the loss (1.8e19 in float32).
    """
    if not isinstance(rewards, torch.Tensor):
        rewards = torch.as_tensor(rewards, dtype=torch.float64)
    if rewards.dim() != 1 or rewards.numel() == 0:
        raise ValueError(f"rewards must be a non-empty 1-D tensor (one per response), got shape {tuple(rewards.shape)}")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf: fix the reward function before computing advantages")
    rewards = rewards.to(torch.float64) if not rewards.is_floating_point() else rewards
    g = rewards.numel()
    centered = rewards - rewards.mean()
    spread = None
    if kind == "mean_centered":
        advantages = centered
    elif g < 2:
        raise ValueError(f"advantage {kind!r} needs a group of at least 2 responses, got 1: raise the group size")
    elif kind == "grpo":
        spread = rewards.std()
        advantages = centered / (spread + eps)
    elif kind == "rloo":
        advantages = centered * (g / (g - 1))
    else:
        raise ValueError(f"unknown advantage kind {kind!r}: choose one of {', '.join(ADVANTAGES)}")
    if not (bool(torch.isfinite(centered).all()) and (spread is None or bool(torch.isfinite(spread)))
            and bool(torch.isfinite(advantages).all())):
        raise UnnormalisableRewards(rewards,
                                    f"their {kind} advantages overflow {_dtype_name(rewards.dtype)} on the way")
    if loss_dtype is not None:
        limit = math.sqrt(torch.finfo(loss_dtype).max)
        largest = float(advantages.abs().max())
        if largest >= limit:
            raise UnnormalisableRewards(rewards, f"their {kind} advantages reach {largest:.3g}, beyond the "
                                                 f"{limit:.3g} the loss can hold in {_dtype_name(loss_dtype)}")
    return advantages


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
