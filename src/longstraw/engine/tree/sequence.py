"""Sequence-level losses over a tree whose trajectories share loss tokens, exactly, in two passes.

The sequence ratio (gspo, luspo) and vespo's weight read a trajectory's whole loss at once, while the walk scores a
shared node's tokens (and any node's with children) a chunk at a time. The loss is L = Σ_i w_i f_i(logp_i) (logp_i:
trajectory i's loss-token log-probs), so its gradient is Σ_i Σ_t (∂L/∂logp_{i,t}) ∇θ logp_{i,t}:

1. the first pass, a walk without grad (`plans.detach`'s), records the log-probs of the trajectories scored in
   pieces (`loss.pieced_sequence_losses`); no full-sequence forward;
2. each such trajectory's term w_i f_i and its gradient g_i = ∂(w_i f_i)/∂logp_i, by autograd on a small detached
   copy of its log-probs through `TreeLoss.term` (its old/ref log-probs, advantage, mask and normaliser);
3. the second pass, the plan's walk, with the term of each such trajectory replaced by the linear surrogate
   Σ_t g_{i,t} (logp_{i,t} − sg(logp_{i,t})) (`TreeLoss.linear`): its gradient is the term's, its value 0, and the
   terms of step 2 are added to the reported loss.

A tree in which every sequence-level loss lies in a leaf of its own (a group, any depth-1 tree) needs no first pass,
nor does the standard plan (every trajectory one full sequence)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from longstraw.engine.options import BackwardOptions
from longstraw.engine.tree.build import Tree
from longstraw.engine.tree.loss import TreeLoss, pieced_sequence_losses
from longstraw.engine.tree.plans import Walk, detach


@dataclass
class FirstPass:
    """What the first pass gives the second: `linear` for `TreeLoss` (trajectory -> g_i (N_i − loss_start,)), the
    sum of those trajectories' terms (`loss`), and its time in seconds."""

    linear: dict[int, torch.Tensor] = field(default_factory=dict)
    loss: float = 0.0
    seconds: float = 0.0


class _Recorder(TreeLoss):
    """A `TreeLoss` that scores nothing: it records the log-probs of the trajectories `only` (the walk computes no
    other log-probs) and gives every piece the value 0, without grad."""

    def __init__(self, tree: Tree, loss: TreeLoss, only: list[int]) -> None:
        super().__init__(tree, loss.cfg, loss.device, loss.dtype)
        self.only = set(only)

    def keep(self, through: list[int], first: int, count: int) -> torch.Tensor:
        return super().keep([i for i in through if i in self.only], first, count)

    def term(self, through: list[int], first: int, logp: torch.Tensor) -> torch.Tensor | None:
        count = logp.numel()
        for i in through:
            lo, hi, in_loss = self._span(i, first, count)
            if i not in self.only or hi <= lo:
                continue
            start = first + lo - self.tree.trajectories[i].loss_start
            piece = logp[lo:hi].detach()
            self.logprobs[i][start: start + hi - lo] = torch.where(
                in_loss, piece, torch.full_like(piece, float("nan"))).to("cpu", self.dtype)
        return logp.detach().new_zeros(())


def first_pass(model: torch.nn.Module, tree: Tree, loss: TreeLoss, options: BackwardOptions) -> FirstPass:
    """Steps 1–2 of the module docstring for `tree` under `loss` (a `TreeLoss` without `linear`) and the plan of
    `options`; an empty `FirstPass` when no trajectory needs it."""
    pieced = [] if not options.plan.captures_state else pieced_sequence_losses(tree, loss.cfg)
    if not pieced:
        return FirstPass()
    t0 = time.perf_counter()
    recorder = _Recorder(tree, loss, pieced)
    with torch.no_grad():
        detach(Walk(model=model, tree=tree, loss=recorder, options=options, grad=False))
    out = FirstPass()
    for i in pieced:
        t = tree.trajectories[i]
        recorded = recorder.logprobs[i]  # (N_i − loss_start,), NaN off the loss tokens
        assert not bool(recorded[t.in_loss()].isnan().any()), f"trajectory {i}: a loss token was not scored"
        x = recorded.nan_to_num(nan=0.0).to(loss.device).requires_grad_(True)
        with torch.enable_grad():
            term = loss.term([i], t.loss_start, x)
            assert term is not None
            (g,) = torch.autograd.grad(term, x)
        out.linear[i] = g.detach()
        out.loss += float(term.detach())
    out.seconds = time.perf_counter() - t0
    return out
