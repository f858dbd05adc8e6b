"""Right-padding of ragged token runs into one batch (sibling responses or leaves replayed at once)."""

from __future__ import annotations

import torch


def pad(seqs: list[torch.Tensor], value: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad 1-D id tensors to (B, T_max); returns (ids, mask) with mask True on real tokens."""
    t = max(s.numel() for s in seqs)
    ids = torch.full((len(seqs), t), value, dtype=torch.long, device=seqs[0].device)
    mask = torch.zeros((len(seqs), t), dtype=torch.bool, device=seqs[0].device)
    for i, s in enumerate(seqs):
        ids[i, : s.numel()] = s
        mask[i, : s.numel()] = True
    return ids, mask
