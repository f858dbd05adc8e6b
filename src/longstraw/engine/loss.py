"""GRPO-family losses and advantage estimators, as pure tensor functions.

Every loss here is a sum over responses of a per-response term once the group's constants are fixed
(G, Σ|o_i|, L_max), so a group replayed one response at a time, k at a time, or all at once gives the same
total: `response_loss` returns the batch's share of the group loss, and the shares add up.

Definitions (docs/design.md §5), with per-token log-probs logp_{i,t}, ratio ρ_{i,t} = exp(logp − old) where `old`
defaults to logp.detach() (on-policy: ρ = 1 but its gradient is that of logp):

* ``grpo``:    L = −(1/G) Σ_i (1/|o_i|) Σ_t min(ρ A_i, clip(ρ, 1−ε_low, 1+ε_high) A_i)
* ``dr_grpo``: L = −(1/(G·L_max)) Σ_i Σ_t min(…)            (L_max = `max_tokens`, default max_i |o_i|)
* ``dapo``:    L = −(1/Σ_i|o_i|) Σ_i Σ_t min(…)              (clip-higher: ε_low 0.2, ε_high 0.28)
* ``gspo``:    s_i = exp((1/|o_i|) Σ_t (logp − old)),  L = −(1/G) Σ_i min(s_i A_i, clip(s_i) A_i)
               (ε_low 3e-4, ε_high 4e-4, the GSPO paper's values)

With ``beta > 0`` the k3 estimate of KL(π‖π_ref), k3 = exp(ref − logp) − (ref − logp) − 1, is added per token
(times β) with the same normalisation as the policy term (for gspo: token-mean per response, then /G).

Options that reproduce other trainers' definitions (TRL's `GRPOTrainer`: `longstraw.integrations.trl` sets them;
docs/trl.md). Each defaults to LongStraw's own definition:

* ``max_tokens``: dr_grpo's L_max (TRL: `max_completion_length`; ours: the group's longest response).
* ``token_normalizer``: dapo's denominator instead of the group's Σ|o_i| (TRL: every completion token of the
  optimizer step's generation batch, so several groups share one denominator).
* ``kl_ratio``: multiply the k3 term by the ratio, ρ_{i,t} (s_i for gspo) — TRL's `use_bias_correction_kl`, its
  default. Its value is k3 on-policy, its gradient is not: ∇(ρ·k3) = k3·∇ρ + ∇k3.
* ``loss_scale``: the group loss times this factor (TRL averages grpo/dr_grpo/gspo over every sequence of the
  optimizer step, N of them: a group of G then weighs G/N).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from longstraw.choices import ADVANTAGES, LOSSES

_DEFAULT_CLIP = {
    "grpo": (0.2, 0.2),
    "dr_grpo": (0.2, 0.2),
    "dapo": (0.2, 0.28),
    "gspo": (3e-4, 4e-4),
}


@dataclass(frozen=True)
class LossConfig:
    """Which loss and its coefficients. Build it with `make_loss_config`, which fills per-loss defaults."""

    kind: str = "grpo"
    epsilon_low: float = 0.2  # lower clip: ratio >= 1 - epsilon_low
    epsilon_high: float = 0.2  # upper clip: ratio <= 1 + epsilon_high
    beta: float = 0.0  # KL coefficient (k3 estimator against ref_logprobs)
    max_tokens: int | None = None  # dr_grpo's L_max; None = longest response in the group
    token_normalizer: float | None = None  # dapo's denominator; None = the group's Σ|o_i|
    kl_ratio: bool = False  # k3 times the ratio (TRL's use_bias_correction_kl)
    loss_scale: float = 1.0  # the group loss times this


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
) -> LossConfig:
    """Validate loss options. `epsilon` sets both clip sides; `epsilon_low`/`epsilon_high` override one side.
    `max_tokens`, `token_normalizer`, `kl_ratio`, `loss_scale`: see the module docstring."""
    if loss not in LOSSES:
        raise ValueError(f"unknown loss {loss!r}: choose one of {', '.join(LOSSES)}")
    low, high = _DEFAULT_CLIP[loss]
    if epsilon is not None:
        low = high = float(epsilon)
    low = float(epsilon_low) if epsilon_low is not None else low
    high = float(epsilon_high) if epsilon_high is not None else high
    for name, value in (("epsilon_low", low), ("epsilon_high", high), ("beta", float(beta))):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    if low >= 1:
        raise ValueError(f"epsilon_low must be < 1 (the ratio's lower clip is 1 - epsilon_low), got {low}")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"max_tokens must be a positive int (dr_grpo's L_max), got {max_tokens!r}")
    if token_normalizer is not None:
        if loss != "dapo":
            raise ValueError(f"token_normalizer is dapo's denominator; the {loss} loss has none (use loss='dapo')")
        if isinstance(token_normalizer, bool) or not isinstance(token_normalizer, (int, float)) or not (
                math.isfinite(token_normalizer) and token_normalizer > 0):
            raise ValueError(f"token_normalizer must be a finite number > 0 (a token count), got {token_normalizer!r}")
    if not isinstance(kl_ratio, bool):
        raise TypeError(f"kl_ratio must be True or False, got {kl_ratio!r}")
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)) or not (
            math.isfinite(loss_scale) and loss_scale > 0):
        raise ValueError(f"loss_scale must be a finite number > 0, got {loss_scale!r}")
    return LossConfig(kind=loss, epsilon_low=low, epsilon_high=high, beta=float(beta), max_tokens=max_tokens,
                      token_normalizer=None if token_normalizer is None else float(token_normalizer),
                      kl_ratio=kl_ratio, loss_scale=float(loss_scale))


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


def _clipped_objective(ratio: torch.Tensor, adv: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """min(ρ A, clip(ρ) A), elementwise; adv broadcasts against ratio."""
    clipped = ratio.clamp(1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_high)
    return torch.minimum(ratio * adv, clipped * adv)


def k3_kl(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(π‖π_ref) per token: exp(ref − logp) − (ref − logp) − 1 (≥ 0, unbiased)."""
    delta = ref - logp
    return torch.exp(delta) - delta - 1.0


def _kl_to(ref_logp: torch.Tensor | None, logp: torch.Tensor) -> torch.Tensor:
    """`k3_kl` against the reference log-probs, which the KL term (beta > 0) needs."""
    if ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp (the reference model's log-probs)")
    return k3_kl(logp, ref_logp)


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
    mask_f = mask.to(logp.dtype)
    lengths = mask_f.sum(-1)  # (B,)
    old = logp.detach() if old_logp is None else old_logp
    delta = (logp - old) * mask_f  # padding contributes 0 (and its logp gets no gradient)
    adv = advantages.to(logp.dtype)
    g = totals.num_responses

    if cfg.kind == "gspo":
        seq_ratio = torch.exp(delta.sum(-1) / lengths)  # (B,)
        per_response = -_clipped_objective(seq_ratio, adv, cfg)
        if cfg.beta:
            kl = (_kl_to(ref_logp, logp) * mask_f).sum(-1) / lengths
            per_response = per_response + cfg.beta * (kl * seq_ratio if cfg.kl_ratio else kl)
        return per_response.sum() / g * cfg.loss_scale

    ratio = torch.exp(delta)
    per_token = -_clipped_objective(ratio, adv[:, None], cfg)  # (B, T)
    if cfg.beta:
        kl = _kl_to(ref_logp, logp)
        per_token = per_token + cfg.beta * (kl * ratio if cfg.kl_ratio else kl)
    per_token = per_token * mask_f
    if cfg.kind == "grpo":
        loss = (per_token.sum(-1) / lengths).sum() / g
    elif cfg.kind == "dr_grpo":
        loss = per_token.sum() / (g * totals.max_tokens)
    elif cfg.kind == "dapo":
        loss = per_token.sum() / totals.total_tokens
    else:
        raise ValueError(f"unknown loss {cfg.kind!r}: choose one of {', '.join(LOSSES)}")
    return loss * cfg.loss_scale


def compute_advantages(rewards: torch.Tensor, kind: str = "grpo", eps: float = 1e-4) -> torch.Tensor:
    """Advantages of one group from its rewards (G,).

    * ``grpo``: (r − mean) / (std + eps), std unbiased as in TRL; needs G ≥ 2.
    * ``mean_centered``: r − mean (Dr. GRPO).
    * ``rloo``: r_i − mean_{j≠i} r_j = G/(G−1) · (r_i − mean); needs G ≥ 2.
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
    if kind == "mean_centered":
        return centered
    if g < 2:
        raise ValueError(f"advantage {kind!r} needs a group of at least 2 responses, got 1: raise the group size")
    if kind == "grpo":
        return centered / (rewards.std() + eps)
    elif kind == "rloo":
        return centered * (g / (g - 1))
    else:
        raise ValueError(f"unknown advantage kind {kind!r}: choose one of {', '.join(ADVANTAGES)}")
