"""The exact plan's extra phase: reverse chunked prompt backward (DESIGN §3).

After every response was replayed against the prompt state as leaves, each leaf's `.grad` holds dL/dK or
dL/dV for its chunk, summed over the whole group. For chunk c = last … first we recompute chunk c's
forward with grad from the chunks before it (also leaves) and backpropagate its K/V with those upstream
gradients: parameters receive the prompt's share of the gradient, and chunks < c receive theirs, ready for
the next iteration. Peak: one chunk's activations + one copy of the state's gradient.
"""

from __future__ import annotations

import torch

from longstraw.replay import run_segment
from longstraw.state.attention import KVState


def prompt_backward(model: torch.nn.Module, ids: torch.Tensor, leaves: KVState) -> None:
    """ids (N,): the encoded prompt (x[:-1]); leaves: the state the replays used, `.grad` filled."""
    for j in reversed(range(leaves.num_chunks)):
        start, end = leaves.bounds[j]
        captured = leaves.chunk_tensors(j)
        upstream = [t.grad for t in captured]
        if all(g is None for g in upstream):
            continue
        collect: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        with torch.enable_grad():
            run_segment(model, ids[start:end].unsqueeze(0), start, leaves.prefix(j), collect, kv_only=True)
        layers = range(leaves.num_layers)
        recomputed = [collect[layer][0] for layer in layers] + [collect[layer][1] for layer in layers]
        pairs = [(out, g) for out, g in zip(recomputed, upstream) if g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        for t in captured:
            t.grad = None  # consumed: free this chunk's state gradient
