"""The detach plan (the source paper's): capture prompt[:-1] once without grad, replay each response from a fork
of that state. The prompt state is a constant, so the gradient misses every path through the prompt's
activations (biased); the exact plan (`exact.py`) adds them back."""

from __future__ import annotations

import time

import torch

from longstraw.engine.options import BackwardOptions
from longstraw.engine.plans.replay import LossFn, replay_responses
from longstraw.engine.router import RouterAux
from longstraw.engine.state.capture import capture_prompt
from longstraw.engine.state.prompt import PromptState


def detach(model: torch.nn.Module, prompt: torch.Tensor, responses: list[torch.Tensor], loss_fn: LossFn,
           options: BackwardOptions, prompt_state: PromptState | None,
           stats: dict[str, float | int | str],
           loss_masks: list[torch.Tensor] | None = None,
           router: RouterAux | None = None) -> tuple[float, list[torch.Tensor]]:
    """prompt (P,), responses [(R_i,)]: the loss's gradient into the parameters, the state held constant.
    Reuses `prompt_state` (prompt[:-1]) when given. Phase times and the state's size go into `stats`. router: the
    router load-balancing term, added in the replays only: like every path through the prompt's activations, the
    prompt tokens' share of its gradient is left out."""
    t0 = time.perf_counter()
    if prompt_state is None:
        state = capture_prompt(model, prompt[:-1], options.chunk_size, keep_boundaries=False,
                               context_shards=options.context_shards, offload=options.offload_state)
    else:
        state = prompt_state.offload(prompt.device) if options.offload_state else prompt_state
    t1 = time.perf_counter()
    total, logprobs = replay_responses(model, prompt, state, responses, loss_fn, options.micro_batch,
                                       options.token_chunk, options.temperature, loss_masks, router)
    stats.update(prompt_state_bytes=state.nbytes(), capture_s=t1 - t0, replay_s=time.perf_counter() - t1,
                 prompt_backward_s=0.0)
    return total, logprobs
