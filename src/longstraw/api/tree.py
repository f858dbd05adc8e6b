"""`backward_tree`: the gradient of a batch of trajectories that share prefixes, accumulated into the parameters.

Read top to bottom, one call is:
  1. the options (as `backward_group`'s) and the tree (`build_tree` from a list of trajectories, or a `Tree`);
  2. every refusal that needs the model, the tree or the options, before anything is computed;
  3. skip when the loss's gradient is identically zero (every advantage 0, beta = 0, no router term);
  4. the loss (`loss.TreeLoss`: each trajectory with its group's normalisers), the first pass of a sequence-level loss
     whose loss tokens are shared (`sequence.first_pass`: a no-grad walk), the router load-balancing term's counting
     pass (`routes.count_routes`, with router_aux_coef > 0) and the plan (`plans`): standard, exact or detach.

`backward_group` runs its group as a one-level tree through `run_tree`."""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from longstraw.admission.admission import is_recurrent
from longstraw.api.checks import check_model_options, check_tokens, options_with
from longstraw.engine.activation_checkpointing import checkpointed_layers
from longstraw.engine.options import BackwardOptions
from longstraw.engine.precision import accumulation_dtype, dtype_name
from longstraw.engine.router import RouterAux, aux_value
from longstraw.engine.state.checks import check_materialised
from longstraw.engine.state.prompt import PromptState
from longstraw.engine.tp_check import check_tensor_parallel_model
from longstraw.engine.tree.build import Trajectory, Tree, build_tree
from longstraw.engine.tree.loss import TreeLoss
from longstraw.engine.tree.plans import Walk, detach, empty_state, exact, standard
from longstraw.engine.tree.routes import TreeRouter, check_routable, count_routes, router_weights
from longstraw.engine.tree.sequence import first_pass
from longstraw.models.architecture import eval_mode_when_equal, hf


@dataclass
class TreeResult:
    """loss: the batch loss (float); logprobs: per trajectory, detached (N_i − loss_start,), NaN at the tokens outside
    its loss; stats: the tree's shape (`Tree.stats`), phase times and the largest state held along one path.
    skipped: "zero_advantage" when every advantage is 0 and beta is 0 (nothing ran), else None."""

    loss: float
    logprobs: list[torch.Tensor]
    stats: dict[str, float | int | str] = field(default_factory=dict)
    skipped: str | None = None


def backward_tree(model: torch.nn.Module, trajectories: list[Trajectory] | Tree,
                  options: BackwardOptions | None = None, *, min_shared: int = 1, **settings: Any) -> TreeResult:
    """Accumulate d(loss)/d(params) into `.grad` for every trajectory, as running each on its own and summing the
    losses would (never zeroes or steps). trajectories: a list of `Trajectory` (its prefix tree is built with
    `min_shared`) or a `Tree`. options/settings: as `backward_group`'s; plan "standard" (every trajectory a full
    sequence: the reference), "exact" (depth first, equal to standard) or "detach" (a node's state a constant for its
    descendants); micro_batch: sibling leaves replayed at once (standard: trajectories per forward)."""
    options = options_with(options, settings, "backward_tree")
    tree = trajectories if isinstance(trajectories, Tree) else build_tree(trajectories, min_shared)
    if options.plan.captures_state and tree.min_shared < 2 and is_recurrent(model):
        # A recurrent layer's one-token step (Mamba-2's selective_state_update) writes its state in place, which
        # autograd cannot differentiate: a one-token inner node's token goes into each of its branches instead.
        tree = build_tree(tree.trajectories, 2)
    training = options.allow_train_mode and any(m.training for m in model.modules())
    with eval_mode_when_equal(model) if training else nullcontext():
        _check(model, tree, options)
        return run_tree(model, tree, options)


def _check(model: torch.nn.Module, tree: Tree, options: BackwardOptions) -> None:
    """What the options alone cannot say: this model and this tree."""
    check_model_options(model, options)
    check_materialised(model, "backward_tree")
    check_tensor_parallel_model(model)
    if options.router_aux_coef:
        check_routable(tree)
    if options.context_shards is not None:
        options.context_shards.check_supported(model)
    longest = max(t.length for t in tree.trajectories)
    check_tokens(model, longest, max(int(t.ids.max()) for t in tree.trajectories),
                 f"the longest trajectory has {longest} tokens, more than the model's max_position_embeddings "
                 "({max_pos}): shorten it or use a longer-context model")
    if options.loss.beta:
        missing = [i for i, t in enumerate(tree.trajectories) if t.ref_logprobs is None]
        if missing:
            raise ValueError(f"beta > 0 needs ref_logprobs on every trajectory (missing on {missing[:5]})")
    dtype = accumulation_dtype(hf(model).get_input_embeddings().weight.dtype)
    bound = math.sqrt(torch.finfo(dtype).max)
    for i, t in enumerate(tree.trajectories):
        if not abs(t.advantage) < bound:
            raise ValueError(f"trajectories[{i}].advantage = {t.advantage:.3g} is too large for the loss's dtype "
                             f"{dtype_name(dtype)}: |advantage| must be < {bound:.3g}; rescale the "
                             "rewards or normalise the advantages")


def run_tree(model: torch.nn.Module, tree: Tree, options: BackwardOptions, root_state: PromptState | None = None,
             names: str = "trajectories") -> TreeResult:
    """Steps 3–4 of the module docstring for a checked tree; root_state: the root's state, captured already (a
    group's reused prompt state: detach's as it is, exact's as leaves); names: what errors call the trajectories. A
    piece of the loss refused before its backward raises FloatingPointError carrying `backwards` (pieces done)."""
    device = hf(model).get_input_embeddings().weight.device
    dtype = accumulation_dtype(hf(model).get_input_embeddings().weight.dtype)
    stats: dict[str, float | int | str] = {"plan": options.plan.name, **tree.stats(), "checkpoint": options.checkpoint,
                                           "offload_state": options.offload_state}
    cfg = options.loss
    if cfg.beta == 0 and cfg.kind != "nll" and not options.router_aux_coef and \
            all(t.advantage == 0 for t in tree.trajectories):
        stats.update(capture_s=0.0, replay_s=0.0, backward_s=0.0, peak_path_state_bytes=0, first_pass_s=0.0)
        return TreeResult(loss=0.0, logprobs=[], stats=stats, skipped="zero_advantage")
    for node in tree.nodes():
        node.tokens = node.tokens.to(device=device, dtype=torch.long)
    loss = TreeLoss(tree, cfg, device, dtype)
    first = first_pass(model, tree, loss, options)  # sequence-level losses over shared loss tokens (sequence.py)
    loss.linear = first.linear
    router = _router(model, tree, options, stats)
    walk = Walk(model=model, tree=tree, loss=loss, options=options, router=router, root_state=root_state, names=names)
    with checkpointed_layers(model, enabled=options.checkpoint == "layers"), \
            router.aux.tap.hooked() if router is not None else nullcontext():
        try:
            if not options.plan.captures_state:
                standard(walk, batched=options.plan.batched)
            elif options.plan.exact_gradient:
                exact(walk)
            else:
                detach(walk)
        except FloatingPointError as err:
            err.backwards = walk.backwards  # type: ignore[attr-defined]
            raise
    stats.update(capture_s=walk.capture_s, replay_s=walk.replay_s, backward_s=walk.backward_s,
                 peak_path_state_bytes=walk.peak_path_bytes, first_pass_s=first.seconds)
    return TreeResult(loss=walk.total + first.loss, logprobs=loss.logprobs, stats=stats)


def _router(model: torch.nn.Module, tree: Tree, options: BackwardOptions,
            stats: dict[str, float | int | str]) -> TreeRouter | None:
    """With router_aux_coef > 0: the counting pass over the tree (tree/routes.py) and the term the walk adds; the
    batch's aux loss value goes into `stats["router_aux_loss"]` (the reported loss leaves the term out)."""
    if not options.router_aux_coef:
        return None
    t0 = time.perf_counter()
    weights = router_weights(tree, options.router_count)
    counts, prob_sums = count_routes(model, tree, empty_state(model, False, options), weights, options.chunk_size,
                                     options.micro_batch)
    stats["router_aux_loss"] = aux_value(counts, prob_sums)
    stats["router_count_s"] = time.perf_counter() - t0
    return TreeRouter(RouterAux(model, counts, options.router_aux_coef), weights)
