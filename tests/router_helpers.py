"""MoE routers computing in float64 inside a float64 model, for the router load-balancing term's tests.

transformers' TopKRouter of Qwen3-MoE, Qwen2-MoE, OLMoE and Mixtral computes its softmax in float32 whatever the
model's dtype, and that softmax's backward casts the gradient reaching it to float32: two computations of the same
gradient that sum its parts in another order (one backward of policy + router term, or two) then differ by float32
rounding. With the softmax in the logits' dtype (as `helpers.faithful_float64` does for the norms) they agree to
float64 rounding, which is what shows the term exact.
"""

from __future__ import annotations

import importlib

import pytest
import torch

ROUTERS = {"qwen3_moe": "Qwen3MoeTopKRouter", "mixtral": "MixtralTopKRouter", "qwen2_moe": "Qwen2MoeTopKRouter",
           "olmoe": "OlmoeTopKRouter"}


def _router_in_input_dtype(self, hidden_states: torch.Tensor):
    """Those routers' forward (hidden (..., d) -> logits (rows, E), top-k weights and indices (rows, k)) with the
    softmax in the logits' dtype. Mixtral always normalises its top-k weights, the others when norm_topk_prob."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = torch.nn.functional.linear(hidden_states, self.weight)
    top, index = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top, index


def patch_routers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every class of `ROUTERS` computing in the input dtype, until the test ends."""
    for family, name in ROUTERS.items():
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        monkeypatch.setattr(getattr(module, name), "forward", _router_in_input_dtype)
