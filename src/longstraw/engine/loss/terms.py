"""The per-token terms of a loss and their normalisation (each loss entry's, `kinds`; defined in docs/design.md §5)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from longstraw.engine.loss.config import LossConfig
from longstraw.engine.loss.kinds import Normaliser, PolicyTerm

_VESPO_MIN_LAMBDA = 1e-4


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
    return torch.where(positive, torch.tensor(if_true, dtype=like.dtype, device=like.device),
                       torch.tensor(if_false, dtype=like.dtype, device=like.device))


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
    """The policy part of the per-token loss (before the mask and the normalisation), by the entry's term; it
    broadcasts to (B, T). logp, log_ratio: (B, T); ratio: (B, T) per token or (B, 1) per sequence; adv: (B, 1)."""
    term = cfg.entry.term
    if term is PolicyTerm.CLIPPED:
        clipped = ratio.clamp(1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_high)
        unclipped = ratio if cfg.delta is None else ratio.clamp(max=cfg.delta)
        return -torch.minimum(unclipped * adv, clipped * adv)
    if term is PolicyTerm.CAPPED_WEIGHT:
        return -ratio.clamp(max=cfg.epsilon_high).detach() * adv * logp
    if term is PolicyTerm.SIGMOID_GATE:
        tau = _by_sign(adv > 0, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg, ratio)
        return -torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * adv
    if term is PolicyTerm.SEQUENCE_WEIGHT:
        return -_vespo_weight(log_ratio, adv, cfg) * adv * logp
    return -logp  # PolicyTerm.NLL


def response_loss(logp: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor, totals: GroupTotals,
                  cfg: LossConfig, old_logp: torch.Tensor | None = None,
                  ref_logp: torch.Tensor | None = None) -> torch.Tensor:
    """This batch's share of the group loss (a scalar); shares of disjoint batches add up to the group loss. logp, mask,
    old_logp, ref_logp: (B, T), right-padded, mask True on real tokens; advantages: (B,)."""
    per_token = token_terms(logp, mask, advantages, cfg, old_logp, ref_logp)  # (B, T)
    lengths = mask.to(logp.dtype).sum(-1)  # (B,)
    g = totals.num_responses
    normaliser = cfg.entry.normaliser
    if normaliser is Normaliser.PER_SEQUENCE:
        loss = (per_token.sum(-1) / lengths).sum() / g
    elif normaliser is Normaliser.MAX_TOKENS:
        loss = per_token.sum() / (g * totals.max_tokens)
    elif normaliser is Normaliser.TOKENS:
        loss = per_token.sum() / totals.total_tokens
    else:  # Normaliser.PER_GROUP
        loss = per_token.sum() / g
    return loss * cfg.loss_scale


def token_weight(cfg: LossConfig, totals: GroupTotals, loss_tokens: int) -> float:
    """The factor `response_loss` divides a response's summed per-token terms by, for a response of `loss_tokens`
    loss tokens in a group of `totals`, times the config's loss_scale: the loss is Σ_i weight_i Σ_t term_{i,t}."""
    g = totals.num_responses
    normaliser = cfg.entry.normaliser
    if normaliser is Normaliser.PER_SEQUENCE:
        weight = 1.0 / (loss_tokens * g)
    elif normaliser is Normaliser.MAX_TOKENS:
        weight = 1.0 / (g * totals.max_tokens)
    elif normaliser is Normaliser.TOKENS:
        weight = 1.0 / totals.total_tokens
    else:  # Normaliser.PER_GROUP
        weight = 1.0 / g
    return weight * cfg.loss_scale


def is_token_level(cfg: LossConfig) -> bool:
    """Whether a token's term depends on its own log-prob only (not on the sequence's other tokens): then the loss of a
    sequence is a sum over any split of its tokens (a prefix tree's nodes). Not so: sequence ratio, vespo's weight."""
    return not cfg.sequence_ratio and cfg.entry.token_level


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
