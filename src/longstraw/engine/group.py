"""`Group`: one shared prompt and its G sampled responses, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _check_ids(name: str, ids: object) -> None:
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.LongTensor of token ids, got {type(ids).__name__}")
    if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise TypeError(f"{name} must hold integer token ids, got dtype {ids.dtype}: pass torch.long ids")
    if ids.dim() != 1:
        raise ValueError(f"{name} must be 1-D (one sequence of token ids), got shape {tuple(ids.shape)}")
    if ids.numel() == 0:
        raise ValueError(f"{name} is empty: it needs at least one token")
    if int(ids.min()) < 0:
        raise ValueError(f"{name} contains a negative token id ({int(ids.min())})")


def _check_float(name: str, t: object, shape: tuple[int, ...], in_loss: torch.Tensor | None = None) -> None:
    """A float tensor of `shape`, finite where `in_loss` (a loss mask) is True, everywhere without one."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if not torch.isfinite(t if in_loss is None else t[in_loss.to(t.device)]).all():
        where = "" if in_loss is None else " at a token in the loss"
        raise ValueError(f"{name} contains NaN or inf{where}: fix the values before the training step")


@dataclass
class Group:
    """A GRPO group: prompt (P,), responses [o_1..o_G] each (R_i,), advantages (G,). old_logprobs / ref_logprobs, when
    given, are one (R_i,) tensor per response: the sampling policy's log-probs (PPO clipping, GSPO) and a frozen
    reference model's (KL penalty). loss_masks, when given, is one (R_i,) bool tensor per response, True where the token
    is the policy's action: False tokens (an agent's tool outputs and observations) run through the model as context but
    add no loss, and every normaliser counts only True tokens (docs/design.md §5). Each response needs a True token."""

    prompt: torch.Tensor
    responses: list[torch.Tensor]
    advantages: torch.Tensor
    old_logprobs: list[torch.Tensor] | None = None
    ref_logprobs: list[torch.Tensor] | None = None
    loss_masks: list[torch.Tensor] | None = None

    def __post_init__(self) -> None:
        _check_ids("prompt", self.prompt)
        if not isinstance(self.responses, (list, tuple)):
            raise TypeError(f"responses must be a list of LongTensors, got {type(self.responses).__name__}")
        if len(self.responses) == 0:
            raise ValueError("responses is empty (G = 0): a group needs at least one response")
        self.responses = list(self.responses)
        for i, r in enumerate(self.responses):
            _check_ids(f"responses[{i}]", r)
        g = len(self.responses)
        if not isinstance(self.advantages, torch.Tensor):
            raise TypeError(f"advantages must be a FloatTensor of shape ({g},), got {type(self.advantages).__name__}")
        _check_float("advantages", self.advantages, (g,))
        if self.loss_masks is not None:
            self._check_loss_masks(g)
        for name in ("old_logprobs", "ref_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, (list, tuple)) or len(value) != g:
                raise ValueError(f"{name} must be a list of {g} tensors, one per response")
            for i, (lp, r) in enumerate(zip(value, self.responses)):
                # Masked tokens' log-probs never reach the loss: checked on the loss tokens only (NaN allowed there).
                in_loss = None if self.loss_masks is None else self.loss_masks[i]
                _check_float(f"{name}[{i}]", lp, (r.numel(),), in_loss)
                if (lp > 0).any():
                    raise ValueError(f"{name}[{i}] has positive values: log-probs must be <= 0")

    def _check_loss_masks(self, g: int) -> None:
        masks = self.loss_masks
        if not isinstance(masks, (list, tuple)) or len(masks) != g:
            raise ValueError(f"loss_masks must be a list of {g} bool tensors, one per response")
        self.loss_masks = list(masks)
        for i, (m, r) in enumerate(zip(masks, self.responses)):
            if not isinstance(m, torch.Tensor) or m.dtype != torch.bool:
                raise TypeError(f"loss_masks[{i}] must be a torch.bool tensor (True: the token is in the loss), got "
                                f"{m.dtype if isinstance(m, torch.Tensor) else type(m).__name__}")
            if tuple(m.shape) != (r.numel(),):
                raise ValueError(f"loss_masks[{i}] must have shape ({r.numel()},) like responses[{i}], got "
                                 f"{tuple(m.shape)}")
            if not bool(m.any()):
                raise ValueError(f"loss_masks[{i}] masks every token of responses[{i}]: a response needs at least "
                                 "one token in the loss (leave it out of the group instead)")

    @property
    def size(self) -> int:
        """G, the number of responses."""
        return len(self.responses)

    @property
    def lengths(self) -> list[int]:
        return [r.numel() for r in self.responses]

    def max_token_id(self) -> int:
        return max(int(self.prompt.max()), *(int(r.max()) for r in self.responses))
