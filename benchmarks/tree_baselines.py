"""The two ways `python -m benchmarks tree` runs a tree step without LongStraw's tree engine, on `Trajectory` lists:

* `flattened_step`: every trajectory as one full sequence through the unmodified model, one at a time with gradient
  accumulation, its logits over every position from loss_start (what TRL and verl do; the engine's `standard` plan
  per trajectory);
* `packed_step`: every token of the prefix tree once in one sequence (`pack_tree`), position ids = depth, an SDPA
  boolean mask where a token sees its ancestors and itself only (the peers' approach: TRL's tree-attention PR,
  AReaL-DTA's packed baseline), one forward and backward through transformers with that 4-D mask; LongStraw's
  chunked log-prob head on the hidden states that predict loss tokens, each once.

Both take the loss `tree_loss` does: Σ over groups of each trajectory's GRPO-family term with its own advantage and
its group's normalisers (`GroupTotals` of the group's loss-token counts), every loss token counted once per
trajectory. Log-probs are the model's at temperature 1 (logits in the accumulation dtype)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from longstraw.engine.logprobs import DEFAULT_TOKEN_CHUNK, chunked_logprobs
from longstraw.engine.loss.config import LossConfig
from longstraw.engine.loss.terms import GroupTotals, response_loss
from longstraw.engine.precision import accumulation_dtype
from longstraw.engine.tree import Trajectory, build_tree


def group_totals(trajectories: list[Trajectory], cfg: LossConfig) -> dict[int, GroupTotals]:
    """Each group's normalisers (G_g, Σ|o|, L_max) from its trajectories' loss-token counts."""
    lengths: dict[int, list[int]] = {}
    for t in trajectories:
        lengths.setdefault(t.group, []).append(t.loss_tokens)
    return {g: GroupTotals.of(ls, cfg) for g, ls in lengths.items()}


def trajectory_loss(logp: torch.Tensor, t: Trajectory, totals: GroupTotals, cfg: LossConfig) -> torch.Tensor:
    """Trajectory t's share of the loss from its log-probs `logp` (|o_t|,) at its loss tokens (in order)."""
    mask = torch.ones(1, logp.numel(), dtype=torch.bool, device=logp.device)
    advantage = torch.tensor([t.advantage], dtype=logp.dtype, device=logp.device)
    return response_loss(logp[None], mask, advantage, totals, cfg)


# ---------------------------------------------------------------- flattened


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def flattened_logprobs(model: torch.nn.Module, t: Trajectory) -> torch.Tensor:
    """(N − loss_start,) log-probs of t's tokens from loss_start, one full forward of its N ids (with grad when
    enabled): the model's logits of the last N − loss_start + 1 positions, as the `standard` plan scores."""
    device = _device(model)
    ids = t.ids.to(device)[None]
    r = t.length - t.loss_start
    logits = model(input_ids=ids, logits_to_keep=r + 1, use_cache=False).logits[0, :-1]  # (r, V)
    logits = logits.to(accumulation_dtype(logits.dtype))
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[0, t.loss_start:, None]).squeeze(-1)


def flattened_step(model: torch.nn.Module, trajectories: list[Trajectory], loss: str = "grpo") -> float:
    """Accumulate the tree loss's gradient trajectory by trajectory (one forward and backward each); the loss."""
    cfg = LossConfig(loss)
    totals = group_totals(trajectories, cfg)
    total = 0.0
    for t in trajectories:
        logp = flattened_logprobs(model, t)
        logp = logp[t.in_loss().to(logp.device)]
        value = trajectory_loss(logp, t, totals[t.group], cfg)
        value.backward()
        total += float(value.detach())
    return total


# ---------------------------------------------------------------- packed tree


@dataclass
class PackedTree:
    """Every node's tokens once, depth first (a parent before its children).

    ids, positions (E + 1,): the tokens and their positions in their trajectories. node (E + 1,): each token's node
    (index into the depth-first node list). ancestors (nodes, nodes) bool: [a, b] = node b is a or an ancestor of a.
    index: per trajectory (N_i,), the packed index of each of its positions."""

    ids: torch.Tensor
    positions: torch.Tensor
    node: torch.Tensor
    ancestors: torch.Tensor
    index: list[torch.Tensor]

    def mask(self) -> torch.Tensor:
        """(E + 1, E + 1) bool, True where query q may attend key k: k's node is q's or an ancestor of it, and k <= q
        (ancestors are packed before their descendants)."""
        n = self.ids.numel()
        causal = torch.ones(n, n, dtype=torch.bool).tril_()
        return self.ancestors[self.node[:, None], self.node[None, :]] & causal


def pack_tree(trajectories: list[Trajectory]) -> PackedTree:
    """The packed form of `build_tree(trajectories)` (`PackedTree`)."""
    tree = build_tree(trajectories)
    nodes = [n for n in tree.nodes() if n.tokens.numel()]
    ids: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    owner: list[torch.Tensor] = []
    offset: dict[int, int] = {}
    parent: list[int] = []
    where = {id(n): i for i, n in enumerate(nodes)}
    for i, n in enumerate(nodes):
        offset[i] = sum(x.numel() for x in ids)
        ids.append(n.tokens)
        positions.append(torch.arange(n.start, n.end))
        owner.append(torch.full((n.tokens.numel(),), i, dtype=torch.long))
        parent.append(-1)
    for i, n in enumerate(nodes):
        for child in n.children:
            parent[where[id(child)]] = i
    ancestors = torch.zeros(len(nodes), len(nodes), dtype=torch.bool)
    for i in range(len(nodes)):
        a = i
        while a >= 0:
            ancestors[i, a] = True
            a = parent[a]
    index = []
    for t_i in range(len(trajectories)):
        path = [i for i, n in enumerate(nodes) if t_i in n.through]  # depth first: root to leaf
        index.append(torch.cat([offset[i] + torch.arange(nodes[i].tokens.numel()) for i in path]))
    return PackedTree(ids=torch.cat(ids), positions=torch.cat(positions), node=torch.cat(owner),
                      ancestors=ancestors, index=index)


def packed_logprobs(model: torch.nn.Module, trajectories: list[Trajectory], packed: PackedTree | None = None,
                    token_chunk: int = DEFAULT_TOKEN_CHUNK) -> list[torch.Tensor]:
    """Per trajectory, the log-probs (|o_i|,) of its loss tokens from one forward of the packed tree under the
    ancestor mask (with grad when enabled). A token several trajectories score is computed once."""
    packed = pack_tree(trajectories) if packed is None else packed
    device = _device(model)
    mask = packed.mask().to(device)[None, None]  # (1, 1, E + 1, E + 1)
    lm: Any = model  # a transformers causal LM: its body `.model` and its output projection
    hidden = lm.model(input_ids=packed.ids.to(device)[None], position_ids=packed.positions.to(device)[None],
                         attention_mask=mask, use_cache=False).last_hidden_state[0]  # (E + 1, d)
    # the packed index of every loss token (its target) and of the token before it on its path (its predictor)
    targets, predictors = [], []
    for t, index in zip(trajectories, packed.index):
        positions = t.loss_start + torch.nonzero(t.in_loss()).flatten()
        targets.append(index[positions])
        predictors.append(index[positions - 1])
    unique, inverse = torch.unique(torch.cat(targets), return_inverse=True)
    predictor_of = torch.empty_like(unique)
    predictor_of[inverse] = torch.cat(predictors)
    logp = chunked_logprobs(hidden[predictor_of.to(device)], lm.get_output_embeddings().weight,
                            packed.ids.to(device)[unique.to(device)], token_chunk)
    out, start = [], 0
    for target in targets:
        out.append(logp[inverse[start:start + target.numel()].to(device)])
        start += target.numel()
    return out


def packed_step(model: torch.nn.Module, trajectories: list[Trajectory], loss: str = "grpo",
                packed: PackedTree | None = None) -> float:
    """Accumulate the tree loss's gradient from one packed forward and one backward; the loss."""
    cfg = LossConfig(loss)
    totals = group_totals(trajectories, cfg)
    logps = packed_logprobs(model, trajectories, packed)
    value = sum((trajectory_loss(lp, t, totals[t.group], cfg) for lp, t in zip(logps, trajectories)),
                torch.zeros((), dtype=logps[0].dtype, device=logps[0].device))
    value.backward()
    return float(value.detach())
