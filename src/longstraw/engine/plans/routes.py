"""The counting pass of the router load-balancing term (`engine/router.py`): every token of the group through the
routers once, without grad, for the top-k counts the term's gradient needs before the first backward.

It runs what the plan runs: the standard plans' full sequences; for detach/exact, the prompt state (captured here
with every chunk boundary, then handed to the plan, so the plan does not capture again), each prompt chunk's full
forward from the state before it (the capture stops at the last layer's state, before its MoE block), and each
response's segment [x[-1]] + o_i (all of o_i: its last token is routed in the full sequence too).
"""

from __future__ import annotations

import torch

from longstraw.engine.hf.segment import run_segment
from longstraw.engine.options import BackwardOptions
from longstraw.engine.pad import pad
from longstraw.engine.router import RouterCounts, RouterTap, count, responses_weights, top_k
from longstraw.engine.state.capture import capture_prompt
from longstraw.engine.state.prompt import PromptState


def count_routes(model: torch.nn.Module, prompt: torch.Tensor, responses: list[torch.Tensor],
                 options: BackwardOptions, prompt_state: PromptState | None,
                 prompt_copies: int) -> tuple[RouterCounts, PromptState | None]:
    """prompt (P,), responses [(R_i,)]: the group's router counts, each prompt token weighing `prompt_copies`
    (the sequences of the batch that hold it) and each response token 1; and the prompt state the replay plans
    can reuse (None for the standard plans)."""
    tap, k = RouterTap(model), top_k(model)
    first = prompt_copies / len(responses)
    parts: list[RouterCounts] = []
    with torch.no_grad(), tap.hooked():
        if options.plan in ("standard", "standard_batched"):
            for r in responses:
                tap.clear()
                model(input_ids=torch.cat([prompt, r])[None], use_cache=False, logits_to_keep=1)
                weights = torch.ones(prompt.numel() + r.numel(), dtype=torch.float64)
                weights[: prompt.numel()] = first
                parts.append(count(tap.take(), weights, k))
            state = None
        else:
            state = prompt_state if prompt_state is not None else capture_prompt(
                model, prompt[:-1], options.chunk_size, keep_boundaries=True, offload=options.offload_state)
            for j, (start, end) in enumerate(state.bounds):
                tap.clear()
                run_segment(model, prompt[start:end].unsqueeze(0), start, state.prefix(j))
                parts.append(count(tap.take(), torch.full((end - start,), float(prompt_copies)), k))
            for lo in range(0, len(responses), options.micro_batch):
                inputs, mask = pad([torch.cat([prompt[-1:], r]) for r in responses[lo:lo + options.micro_batch]])
                tap.clear()
                run_segment(model, inputs, prompt.numel() - 1, state.fork())
                parts.append(count(tap.take(), responses_weights(mask, first), k))
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total.rounded(), state
