"""The checks every entry point that runs a model from a prompt state makes first (`backward_group`, `sample_group`,
`score_responses`): the model's weights exist, and a reused state belongs to this prompt, this model and these
weights. A state of another layer count or K/V-head layout would otherwise reach the cache and the attention kernels
with the wrong shapes (a misleading error, an IndexError, or a crashed process)."""

from __future__ import annotations

import torch

from longstraw.engine.state.prompt import PromptState, prompt_fingerprint
from longstraw.engine.state.provenance import mismatch, provenance


def check_materialised(model: torch.nn.Module, caller: str) -> None:
    """Refuse a model with a parameter or buffer on the meta device (a shape without data, as left by building
    under `torch.device("meta")` or an unfinished lazy load): every forward would fail deep inside, naming nothing."""
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, tensor in named:
            if tensor.is_meta:
                raise ValueError(f"{kind} {name} is on the meta device (a shape with no data): load or initialise the "
                                 "model's weights (e.g. load_model(...), or to_empty(device=...) and then "
                                 f"load_state_dict) before {caller}")


def check_prompt_state(model: torch.nn.Module, state: PromptState, prompt: torch.Tensor) -> None:
    """Refuse a reused `state` that was not captured for `prompt`[:-1] by this model with its current weights."""
    if not isinstance(state, PromptState):
        raise TypeError(f"prompt_state must be a PromptState (from capture_prompt or sample_group), got "
                        f"{type(state).__name__}")
    if state.length != prompt.numel() - 1:
        raise ValueError(f"prompt_state holds {state.length} positions but this prompt needs {prompt.numel() - 1} "
                         "(all but its last token): pass the state captured for this prompt, or none")
    if state.fingerprint is None:
        raise ValueError("prompt_state records no prompt fingerprint (it was not made by capture_prompt or "
                         "sample_group, or it is a prefix of a state): pass one they captured for this prompt, or none")
    if state.fingerprint != prompt_fingerprint(prompt[:-1]):
        raise ValueError("prompt_state was captured for another prompt of the same length (its tokens differ from "
                         "this prompt[:-1]): pass the state captured for this prompt, or none")
    why = "it records no model" if state.provenance is None else mismatch(state.provenance, provenance(model))
    if why is not None:
        raise ValueError(f"prompt_state does not belong to this model and its current weights: {why}. Pass a state "
                         "captured by this model since its last update, or none")
