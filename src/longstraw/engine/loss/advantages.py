"""Advantages of one group from its rewards (`compute_advantages`); rewards too large to normalise are refused."""

from __future__ import annotations

import math

import torch

from longstraw.choices import ADVANTAGES
from longstraw.engine.precision import dtype_name


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

    Finite rewards can still be too large to normalise (grpo's std overflows float64 once |reward| nears 1e154):
    advantages that would be silently 0, inf or NaN are refused (`UnnormalisableRewards`, a ValueError). With
    `loss_dtype` they must also stay below the square root of its largest value, the bound `backward_group`
    enforces in the loss (1.8e19 in float32)."""
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
        raise UnnormalisableRewards(rewards, f"their {kind} advantages overflow {dtype_name(rewards.dtype)} on the way")
    if loss_dtype is not None:
        limit = math.sqrt(torch.finfo(loss_dtype).max)
        largest = float(advantages.abs().max())
        if largest >= limit:
            raise UnnormalisableRewards(rewards, f"their {kind} advantages reach {largest:.3g}, beyond the "
                                                 f"{limit:.3g} the loss can hold in {dtype_name(loss_dtype)}")
    return advantages
