"""The exact plan (ours; docs/design.md §3): the detach plan's replays with the prompt state as grad-requiring
leaves, then the reverse chunked prompt backward, so the gradient equals standard GRPO's.

After every response was replayed against the prompt state as leaves, each leaf's `.grad` holds dL/dS for
its part of the state (K/V or latent chunks, and for recurrent layers the state after the last chunk),
summed over the whole group. For chunk c = last … first we recompute chunk c's forward with grad from the
state before it (K/V chunks < c and the recurrent state after chunk c-1, all leaves) and backpropagate what
chunk c produced — its K/V slice and its end-of-chunk recurrent/conv state — with the upstream gradients
accumulated so far: parameters receive the prompt's share of the gradient, and the state before chunk c
receives its share, ready for the next iteration. Peak: one chunk's activations + one copy of the state's
gradient.

Kept graphs (`backward_group(keep_prompt_graph=N)`): the capture ran the last N chunks with grad from the leaves
and kept their graphs (`PromptState.graphs`); for those chunks the backward goes through the kept graph instead of
a recompute: one prompt forward fewer per kept chunk, for those chunks' activations held from the capture on.
"""

from __future__ import annotations

import time

import torch

from longstraw.engine.backprop import prompt_backward
from longstraw.engine.options import BackwardOptions
from longstraw.engine.plans.replay import LossFn, replay_responses
from longstraw.engine.router import RouterAux
from longstraw.engine.state.capture import capture_prompt
from longstraw.engine.state.prompt import PromptState


def exact(model: torch.nn.Module, prompt: torch.Tensor, responses: list[torch.Tensor], loss_fn: LossFn,
          options: BackwardOptions, prompt_state: PromptState | None,
          stats: dict[str, float | int | str],
          loss_masks: list[torch.Tensor] | None = None,
          router: RouterAux | None = None) -> tuple[float, list[torch.Tensor]]:
    """prompt (P,), responses [(R_i,)]: the loss's full gradient into the parameters. Captures prompt[:-1] as
    leaves (with its last `keep_prompt_graph` chunks' graphs), or makes leaves of `prompt_state`; replays every
    response; then backpropagates the prompt. Phase times and the state's size go into `stats`. router: the router
    load-balancing term, added in the replays and in the prompt backward."""
    t0 = time.perf_counter()
    if prompt_state is None:
        state = capture_prompt(model, prompt[:-1], options.chunk_size, keep_boundaries=True,
                               context_shards=options.context_shards, offload=options.offload_state, leaves=True,
                               keep_graph=options.keep_prompt_graph)
    else:
        state = (prompt_state.offload(prompt.device) if options.offload_state else prompt_state).as_leaves()
    t1 = time.perf_counter()
    total, logprobs = replay_responses(model, prompt, state, responses, loss_fn, options.micro_batch,
                                       options.token_chunk, options.temperature, loss_masks, router)
    t2 = time.perf_counter()
    prompt_backward(model, prompt[:-1], state, router)
    stats.update(prompt_state_bytes=state.nbytes(), capture_s=t1 - t0, replay_s=t2 - t1,
                 prompt_backward_s=time.perf_counter() - t2)
    return total, logprobs
