"""The loss of a prefix tree, taken a run of positions at a time.

The batch loss is Σ_i w_i Σ_{t ∈ loss_i} term(logp_t; old_{i,t}, ref_{i,t}, A_i) (`loss.token_terms`), with w_i the
normaliser of trajectory i in its group (`loss.token_weight`: GRPO's 1/(G_g |o_i|), dr_grpo's 1/(G_g L_max), dapo's
1/Σ_g|o|, times loss_scale). A token at position t of a node is on the path of every trajectory in `node.through`:
its log-prob logp_t is computed once, and the term is added once for each of those trajectories that has t in its
loss, with that trajectory's own fields. For the token-level losses the loss of a node's run of positions is then a
sum of independent pieces, which the plans add in any order; the sequence-level losses (the sequence ratio, vespo)
need each trajectory's loss tokens in one piece: a trajectory whose loss tokens lie in a shared node or a node with
children takes the linear surrogate of its term (`linear`, computed by a first no-grad walk: engine/tree/sequence.py).
"""

from __future__ import annotations

import numpy as np
import torch

from longstraw.engine.loss.config import LossConfig
from longstraw.engine.loss.terms import GroupTotals, is_token_level, token_terms, token_weight
from longstraw.engine.tree.build import Node, Tree


class TreeLoss:
    """The loss of `tree` under `cfg`, in `dtype` on `device`; collects each trajectory's log-probs as they are
    computed (`logprobs`: (N_i − loss_start,), NaN where none was computed).

    linear: trajectory i -> g_i (N_i − loss_start,), the gradient of its weighted term with respect to its loss
    tokens' log-probs: its term is then the surrogate Σ_t g_{i,t} (logp_t − sg(logp_t)), whose value is 0 and whose
    gradient is its term's (engine/tree/sequence.py: the sequence-level losses over shared loss tokens)."""

    def __init__(self, tree: Tree, cfg: LossConfig, device: torch.device, dtype: torch.dtype,
                 linear: dict[int, torch.Tensor] | None = None) -> None:
        self.tree, self.cfg, self.device, self.dtype = tree, cfg, device, dtype
        self.linear = linear or {}
        by_group: dict[int, list[int]] = {}
        for t in tree.trajectories:
            by_group.setdefault(t.group, []).append(t.loss_tokens)
        totals = {g: GroupTotals.of(lengths, cfg) for g, lengths in by_group.items()}
        self.weights = [token_weight(cfg, totals[t.group], t.loss_tokens) for t in tree.trajectories]
        self.masks = [t.in_loss().to(device) for t in tree.trajectories]
        self.logprobs = [torch.full((t.length - t.loss_start,), float("nan"), dtype=dtype)
                         for t in tree.trajectories]
        # each trajectory's loss positions [loss_start, length), to pick those that meet a run at once (`_meeting`)
        self._starts = np.array([t.loss_start for t in tree.trajectories], dtype=np.int64)
        self._ends = np.array([t.length for t in tree.trajectories], dtype=np.int64)

    def token_level(self, through: list[int]) -> bool:
        """Whether each token's term for the trajectories `through` reads its own log-prob only (a token-level loss,
        or every one of them scored by its linear surrogate)."""
        return is_token_level(self.cfg) or all(i in self.linear for i in through)

    def keep(self, through: list[int], first: int, count: int) -> torch.Tensor:
        """(count,) bool: positions first … first+count−1 in the loss of any trajectory of `through`."""
        keep = torch.zeros(count, dtype=torch.bool, device=self.device)
        for i in self._meeting(through, first, count):
            lo, hi, rows = self._span(i, first, count)
            if hi > lo:
                keep[lo:hi] |= rows
        return keep

    def _meeting(self, through: list[int], first: int, count: int) -> list[int]:
        """The trajectories of `through` whose loss positions meet [first, first+count) (a deep chain's node lies on
        the path of every later trajectory, most of which score elsewhere)."""
        idx = np.asarray(through, dtype=np.int64)
        return idx[np.maximum(self._starts[idx], first) < np.minimum(self._ends[idx], first + count)].tolist()

    def _span(self, i: int, first: int, count: int) -> tuple[int, int, torch.Tensor]:
        """Where trajectory i's loss tokens meet positions [first, first+count): [lo, hi) in that run, its loss mask."""
        t = self.tree.trajectories[i]
        lo = max(t.loss_start, first)
        hi = min(t.length, first + count)
        if hi <= lo:
            return 0, 0, self.masks[i][:0]
        return lo - first, hi - first, self.masks[i][lo - t.loss_start: hi - t.loss_start]

    def term(self, through: list[int], first: int, logp: torch.Tensor) -> torch.Tensor | None:
        """The loss's part at positions first … first+T−1 for the trajectories `through` (their shared tokens);
        logp (T,): the log-probs of those positions' tokens (anything where `keep` is False). None when no
        trajectory has a loss token there. Records the log-probs."""
        count = logp.numel()
        rows, masks, olds, refs, advantages, weights = [], [], [], [], [], []
        surrogates: list[torch.Tensor] = []
        for i in self._meeting(through, first, count):
            lo, hi, in_loss = self._span(i, first, count)
            if hi <= lo or not bool(in_loss.any()):
                continue
            t = self.tree.trajectories[i]
            start = first + lo - t.loss_start  # index into the trajectory's loss fields
            piece = logp[lo:hi]
            self.logprobs[i][start: start + hi - lo] = torch.where(
                in_loss, piece.detach(), torch.full_like(piece.detach(), float("nan"))).to("cpu", self.dtype)
            if i in self.linear:
                g = self.linear[i][start: start + hi - lo]
                surrogates.append(torch.where(in_loss, g * (piece - piece.detach()), 0.0).sum())
                continue
            rows.append(piece)
            masks.append(in_loss)
            olds.append(self._field(t.old_logprobs, start, hi - lo, piece, in_loss))
            refs.append(self._field(t.ref_logprobs, start, hi - lo, piece, in_loss))
            advantages.append(t.advantage)
            weights.append(self.weights[i])
        if not rows:
            return torch.stack(surrogates).sum() if surrogates else None
        width = max(r.numel() for r in rows)

        def stacked(values: list[torch.Tensor], fill: float | bool) -> torch.Tensor:
            """(M, width), right-padded."""
            return torch.stack([torch.nn.functional.pad(v, (0, width - v.numel()), value=fill) for v in values])

        logp_rows = stacked(rows, 0.0)
        mask = stacked(masks, False)
        old, ref = stacked(olds, 0.0), stacked(refs, 0.0)
        adv = torch.tensor(advantages, dtype=self.dtype, device=self.device)
        per_token = token_terms(logp_rows, mask, adv, self.cfg, old, ref)  # (M, width)
        w = torch.tensor(weights, dtype=self.dtype, device=self.device)
        return sum(surrogates, (per_token.sum(-1) * w).sum())

    def _field(self, values: torch.Tensor | None, start: int, count: int, logp: torch.Tensor,
               in_loss: torch.Tensor) -> torch.Tensor:
        """A trajectory's old/ref log-probs over `count` tokens from `start`, in the loss's dtype; off its loss tokens
        the policy's own detached log-probs (a ratio of 1 and a KL of 0 there, whatever the caller holds: NaN times the
        mask's 0 would still be NaN). Without values (on-policy, or no reference with beta = 0): the policy's own."""
        if values is None:
            return logp.detach().to(self.dtype)
        piece = values[start: start + count].to(device=self.device, dtype=self.dtype)
        return torch.where(in_loss, piece, logp.detach().to(self.dtype))


def pieced_sequence_losses(tree: Tree, cfg: LossConfig) -> list[int]:
    """The trajectories whose sequence-level loss the walk (exact, detach) scores in more than one piece: loss tokens
    in a node other than a leaf replayed on its own (a shared node, a node with children, or the root, whose chunks
    are scored one at a time). They need the first pass (engine/tree/sequence.py); empty for a token-level loss."""
    if is_token_level(cfg):
        return []
    starts = np.array([t.loss_start for t in tree.trajectories], dtype=np.int64)
    found = np.zeros(len(tree.trajectories), dtype=bool)
    for node in tree.nodes():
        if node.is_leaf and node is not tree.root:
            continue
        idx = np.asarray(node.through, dtype=np.int64)
        # loss tokens start at loss_start: none in the node unless it starts before the node's end
        for i in idx[~found[idx] & (starts[idx] < node.end)].tolist():
            mask = tree.trajectories[i].in_loss()  # positions loss_start … N−1
            found[i] = bool(mask[max(node.start - starts[i], 0): max(node.end - starts[i], 0)].any())
    return np.flatnonzero(found).tolist()


def node_first_target(node: Node) -> int:
    """The first position whose token the node's forward predicts: its start, or 1 for a node at position 0."""
    return max(node.start, 1)
