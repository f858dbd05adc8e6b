"""The FLOP-count floor of a step: the matrix products each plan must run, counted from the model's dimensions.

A measured time ratio of two plans is read against the ratio of their counts (the floor ratio): a share of 1.0 means
the faster plan saves exactly the work it skips.

* body: per token, 2 × the decoder's matrix weights (attention projections and MLP), `Costs.linear`; per (query,
  key) pair of a full-attention layer, 4 × heads × head_dim (QKᵀ and the weighted sum of V), `Costs.pair`. A forward
  of n tokens after `context` positions costs linear·n + pair·(n·context + n(n+1)/2).
* head: 2·V·d per scored token (`Costs.head`), a loss token's log-prob.
* a backward is two forwards: a token with grad costs 3 body passes and 3 head products (logits, their gradients
  with respect to the hidden state and to the weight). No recompute is counted: the floor is the work itself.
* a pair whose key and value are constants (a detached prompt state) needs the query's gradient alone: 2 passes, not
  3 (the forward, and dP = dO·Vᵀ with dQ = dS·K; no dK, dV).

Per group (P prompt tokens, G responses of R):
  standard  G · 3 · (body(P + R − 1) + head·R)
  detach    body(P − 1) + G · 3 · (body(R after P − 1) + head·R)          the prompt once, without grad,
              − G · pair · R · (P − 1)                                   its pairs with the replies in 2 passes
  exact     4 · body(P − 1) + G · 3 · (body(R after P − 1) + head·R)      + the prompt's recompute and backward
  shared    3 · body(P − 1) + G · 3 · (...)                              the prompt once with grad (Prefix Grouper)
Activation checkpointing adds one forward of what it checkpoints (`checkpointed`).
Per prefix tree, node by node (its inputs after its input start; the loss tokens its inputs predict):
  flattened every trajectory as standard; packed 3 passes of every node; tree_exact 4 of an inner node and 3 of a
  leaf; tree_detach 1 of an inner node without loss tokens, 3 of the others (2 of their pairs with earlier nodes,
  whose states are constants); group per task as a group.
Norms, activations, RoPE, softmax and the loss are elementwise and not counted. A model with a layer that is not full
attention or an MLP that is not dense (hybrids, MoE, MLA) has no count here (`costs` returns None).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DENSE_ATTENTION = ("llama", "qwen2", "qwen3")  # model types whose every layer is full attention + a dense MLP

GROUP_FORMULAS = {
    "standard": "G * 3 * (body(P + R - 1) + head * R)",
    "detach": "body(P - 1) + G * (3 * (body(R after P - 1) + head * R) - pair * R * (P - 1))",
    "exact": "4 * body(P - 1) + G * 3 * (body(R after P - 1) + head * R)",
    "shared": "3 * body(P - 1) + G * 3 * (body(R after P - 1) + head * R)",
}
NOTE = ("FLOP floor: the matrix products a plan must run (benchmarks/flops.py): the body's projections and MLP, "
        "attention's quadratic part, the output projection on loss tokens; a backward as two forwards (one where the "
        "keys are constants), no recompute")


@dataclass(frozen=True)
class Costs:
    """FLOPs per body token (`linear`), per attended (query, key) pair over the layers (`pair`), per scored token
    (`head`)."""

    linear: int
    pair: int
    head: int

    def body(self, n: int, context: int = 0) -> int:
        """A forward of n tokens after `context` positions."""
        return self.linear * n + self.pair * (n * context + n * (n + 1) // 2)


def costs(config: Any) -> Costs | None:
    """The costs of a transformers config (its text config for a composite model), None for a family the count does
    not cover (module docstring)."""
    text = getattr(config, "text_config", None) or config
    if text.model_type not in DENSE_ATTENTION or getattr(text, "use_sliding_window", False):
        return None
    d, heads, layers = text.hidden_size, text.num_attention_heads, text.num_hidden_layers
    kv = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or d // heads
    per_layer = d * heads * head_dim * 2 + d * kv * head_dim * 2 + 3 * d * text.intermediate_size
    return Costs(linear=2 * layers * per_layer, pair=4 * heads * head_dim * layers, head=2 * text.vocab_size * d)


def preset_costs(model: str) -> Costs | None:
    """`costs` of a preset by name; None for anything else (a checkpoint directory: no count)."""
    from longstraw.models.presets import PRESETS

    return costs(PRESETS[model]()) if model in PRESETS else None


def group_flops(c: Costs, plan: str, prompt: int, response: int, group_size: int, scored: int | None = None) -> int:
    """A group step's count (the module docstring's formulas); scored: the loss tokens of a response (R; fewer
    when it holds masked observation tokens)."""
    scored = response if scored is None else scored
    replies = group_size * 3 * (c.body(response, prompt - 1) + c.head * scored)
    if plan == "standard":
        return group_size * 3 * (c.body(prompt + response - 1) + c.head * scored)
    if plan == "detach":  # the replies' pairs with the constant prompt state: dQ alone in the backward
        return c.body(prompt - 1) + replies - group_size * c.pair * response * (prompt - 1)
    if plan == "exact":
        return 4 * c.body(prompt - 1) + replies
    if plan == "shared":  # the prompt once with grad, every response attending to it (Prefix Grouper)
        return 3 * c.body(prompt - 1) + replies
    raise ValueError(f"no FLOP count for plan {plan!r}: one of {', '.join(GROUP_FORMULAS)}")


def checkpointed(c: Costs, plan: str, prompt: int, response: int, group_size: int) -> int:
    """The forward activation checkpointing runs again: every sequence's (standard), the prompt's and the responses'
    (shared), the responses' (detach, exact)."""
    replies = group_size * c.body(response, prompt - 1)
    if plan == "standard":
        return group_size * c.body(prompt + response - 1)
    return replies + (c.body(prompt - 1) if plan == "shared" else 0)


def group_floor(c: Costs | None, plan: str, prompt: int, response: int, group_size: int,
                scored: int | None = None) -> float | None:
    """standard's count over `plan`'s at that shape: the ratio a measured standard/plan time is read against."""
    if c is None:
        return None
    shape = (prompt, response, group_size, scored)
    return group_flops(c, "standard", *shape) / group_flops(c, plan, *shape)


def tree_flops(c: Costs, row: str, trajectories: list[Any]) -> int:
    """A tree step's count for a row of `bench tree` over `trajectories` (engine Trajectory values)."""
    from longstraw.engine.tree.build import build_tree

    def scored(t: Any) -> int:
        return int(t.in_loss().sum())

    if row == "flattened":
        return sum(3 * (c.body(t.length - 1) + c.head * scored(t)) for t in trajectories)
    if row == "group":
        total = 0
        for t in trajectories:  # each task's prompt (its S + C tokens) counted once per task below
            total += 3 * (c.body(t.length - t.loss_start, t.loss_start - 1) + c.head * scored(t))
        prompts = {(t.group, t.loss_start) for t in trajectories}
        return total + sum(4 * c.body(start - 1) for _, start in prompts)
    import torch

    tree = build_tree(trajectories)
    masks = [t.in_loss() for t in trajectories]  # over positions loss_start … N − 1
    total = 0
    for node in tree.nodes():
        n = node.end - 1 - node.input_start  # its inputs: positions input_start … end − 2
        body = c.body(n, node.input_start)
        first = max(node.start, 1)  # the positions its inputs predict: first … end − 1
        hit = torch.zeros(max(node.end - first, 0), dtype=torch.bool)
        for i in node.through:
            t = trajectories[i]
            lo, hi = max(first, t.loss_start), min(node.end, t.length)
            if hi > lo:
                hit[lo - first: hi - first] |= masks[i][lo - t.loss_start: hi - t.loss_start]
        loss = int(hit.sum())
        if row == "packed" or node.is_leaf and node is not tree.root:
            passes = 3
        elif row == "tree_exact":
            passes = 4
        elif row == "tree_detach":
            passes = 3 if loss else 1
        else:
            raise ValueError(f"no FLOP count for row {row!r}")
        total += passes * body + 3 * c.head * loss
        if row == "tree_detach" and passes == 3:  # its pairs with the constant states above it: dQ alone
            total -= c.pair * n * node.input_start
    return total


def tree_floors(c: Costs | None, trajectories: list[Any], rows: tuple[str, ...]) -> dict[str, float | None]:
    """Per row, flattened's count over the row's (None without a count)."""
    if c is None:
        return {row: None for row in rows}
    flattened = tree_flops(c, "flattened", trajectories)
    return {row: flattened / tree_flops(c, row, trajectories) for row in rows}
