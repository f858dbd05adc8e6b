"""One prefix tree over a host's batch (TRL's micro-batch, verl's mini-batch), shared by both integrations: which
options a tree cannot run (the integration then takes its per-group path), the tree of a batch's trajectories or
the reason it cannot take this batch, and the log of each reason the per-group path was taken for.

The integrations make each row its own group in the tree (`Trajectory.group` = the row's index): TRL's and verl's
losses normalise over the whole batch (every row weighs 1/B, or every token 1/N), not over a prompt's G rows, so the
row's weight is the tree loss's per-group normaliser with G = 1 times the batch-wide `loss_scale`, whatever number
of rows each prompt kept (docs/trl.md, docs/verl.md).
"""

from __future__ import annotations

import logging

from longstraw.engine.options import BackwardOptions
from longstraw.engine.tree.build import Trajectory, Tree, build_tree
from longstraw.engine.tree.loss import check_sequence_losses

log = logging.getLogger(__name__)

def tree_refusals(options: BackwardOptions, *, router_aux: bool = False) -> list[str]:
    """Why `options` cannot run on a tree (empty: they can); the per-group path then runs them. router_aux: the host
    sets router_aux_coef per group, later."""
    out = []
    if options.keep_prompt_graph:
        out.append("keep_prompt_graph > 0 keeps a group prompt's capture graphs; a tree recomputes every node")
    if options.router_aux_coef or router_aux:
        out.append("the MoE load-balancing loss (router_aux_coef > 0) is counted per group")
    return out


def tree_of(trajectories: list[Trajectory], options: BackwardOptions, min_shared: int) -> tuple[Tree | None, str]:
    """The tree of `trajectories`, or None and the reason it cannot take them under `options`' loss: a sequence-level
    loss (the sequence ratio, vespo) needs each trajectory's loss tokens in one leaf of its own, which rows sharing
    completion tokens (successive turns, completions starting alike) do not have."""
    tree = build_tree(trajectories, min_shared)
    try:
        check_sequence_losses(tree, options.loss_config)
    except ValueError as err:
        return None, str(err)
    return tree, ""


class Fallbacks:
    """Logs (a warning, once per distinct reason) why a batch took the per-group path, and keeps the reasons."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.reasons: list[str] = []

    def note(self, reason: str) -> None:
        if reason not in self.reasons:
            self.reasons.append(reason)
            log.warning("%s: one prefix tree per batch cannot run here, so each prompt's group runs backward_group "
                        "(the same gradient; shared prefixes across groups encoded once per group): %s",
                        self.host, reason)
