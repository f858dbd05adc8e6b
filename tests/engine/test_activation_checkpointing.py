"""Per-layer activation checkpointing (`checkpoint="layers"`): the same gradients and log-probs as without it, on
every supported family and every plan (float64), and it really keeps only the layers' inputs."""

from __future__ import annotations

import pytest
import torch
from helpers import ARCH_FAMILIES, SAME_ORDER_F64, assert_close, gradient_tolerance, grads, random_group, tiny_model

from longstraw import backward_group
from longstraw.engine.activation_checkpointing import checkpointed_layers, decoder_layers
from longstraw.engine.hf.segment import run_segment
from longstraw.engine.state.capture import capture_prompt

FAMILIES = ("llama", "qwen3", *ARCH_FAMILIES)
PLANS = ("standard", "standard_batched", "detach", "exact")
_MODELS: dict[str, torch.nn.Module] = {}


def _model(family: str) -> torch.nn.Module:
    if family not in _MODELS:
        _MODELS[family] = tiny_model(family)
    return _MODELS[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpointing_changes_no_gradient(family):
    """Every plan with and without checkpointing: relative gradient error <= 1e-12, log-probs <= 1e-12
    (P = 300 in chunks of 13, 120 for Mamba-1: many prompt-backward chunks, recurrent boundaries and windows;
    ragged G = 3, one single-token response, micro-batch 2).
    The exact plan with checkpointing also equals `standard`."""
    model = _model(family)
    # Mamba-1's scan runs token by token: 120 positions (10 chunks) keep its case within seconds
    group = random_group(120 if family in ("mamba", "falcon_mamba", "jamba") else 300, [5, 1, 9], seed=11)
    out = {}
    for plan in PLANS:
        for checkpoint in ("none", "layers"):
            model.zero_grad()
            result = backward_group(model, group, plan=plan, chunk_size=13, micro_batch=2, checkpoint=checkpoint)
            out[plan, checkpoint] = (grads(model).clone(), result.logprobs)
            assert result.stats["checkpoint"] == checkpoint
        (g_plain, lp_plain), (g_ck, lp_ck) = out[plan, "none"], out[plan, "layers"]
        assert_close(f"g_ck {plan}", g_plain, g_ck, SAME_ORDER_F64)
        assert max(float((a - b).abs().max()) for a, b in zip(lp_ck, lp_plain)) <= 1e-12, plan
    assert_close('out["exact", "layers"][0]', out["standard", "none"][0], out["exact", "layers"][0],
                 gradient_tolerance(family))


def _saved_bytes(model, state, segment, checkpoint: bool) -> tuple[int, int]:
    """(bytes autograd saves outside the checkpointed layers, number of decoder-layer forward calls)."""
    saved = []
    calls = []
    hooks = [layer.register_forward_pre_hook(lambda *a: calls.append(1)) for layer in decoder_layers(model)]

    def pack(t: torch.Tensor):
        saved.append(t.numel() * t.element_size())
        return t

    try:
        hooks_on = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        with checkpointed_layers(model, enabled=checkpoint), hooks_on:
            hidden = run_segment(model, segment, state.length, state.fork())
        hidden.sum().backward()
    finally:
        for h in hooks:
            h.remove()
    return sum(saved), len(calls)


@pytest.mark.parametrize("family", ["llama", "qwen3_next-A", "mamba2"])
def test_checkpointing_keeps_only_layer_inputs(family):
    """With checkpointing, what autograd keeps outside the layers is a small fraction of what it keeps without
    (each layer's input only); the layers still run once each in the forward (the recompute happens inside the
    checkpoint, not through the module call)."""
    model = _model(family)
    state = capture_prompt(model, torch.arange(40), chunk_size=16).as_leaves()
    segment = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    plain, plain_calls = _saved_bytes(model, state, segment, checkpoint=False)
    ck, ck_calls = _saved_bytes(model, state, segment, checkpoint=True)
    layers = len(decoder_layers(model))
    assert plain_calls == ck_calls == layers
    assert ck < plain / 3, (ck, plain)
    # The state leaves a replay reads got gradient through the recomputes: every K/V chunk, the last recurrent state.
    last = state.chunk_outputs(state.num_chunks - 1)
    kv = [t for layer in state.parts["key"] + state.parts["value"] for t in layer if t is not None]
    assert all(t.grad is not None for t in kv + [t for t in last if t is not None])


def test_checkpoint_option_is_validated(tiny_llama64):
    group = random_group(10, [3, 4])
    before = [p.grad for p in tiny_llama64.parameters()]
    with pytest.raises(ValueError, match="checkpoint must be one of none, layers"):
        backward_group(tiny_llama64, group, checkpoint="all")
    assert [p.grad for p in tiny_llama64.parameters()] == before


def test_layers_are_restored_after_the_block():
    model = _model("llama")
    with checkpointed_layers(model), checkpointed_layers(model):  # nested: the inner block leaves them wrapped
        assert all("forward" in vars(layer) for layer in decoder_layers(model))
    assert all("forward" not in vars(layer) for layer in decoder_layers(model))
