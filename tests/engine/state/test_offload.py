"""Offloaded prompt state (`offload_state=True`): kept in host memory, copied to the compute device where it is
read, gradients accumulated beside it. The same gradients as the resident state, on every family."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import ARCH_FAMILIES, SAME_ORDER_F64, assert_close, grads, random_group, tiny_model

from longstraw import backward_group
from longstraw.engine.state.capture import capture_prompt

_MODELS: dict[str, torch.nn.Module] = {}


def _model(family: str) -> torch.nn.Module:
    if family not in _MODELS:
        _MODELS[family] = tiny_model(family)
    return _MODELS[family]


@pytest.mark.parametrize("family", ("llama", *ARCH_FAMILIES))
def test_offloaded_state_gives_the_same_gradient(family):
    """exact with per-layer checkpointing (the setting offloading is for) and without, detach with it: float64,
    relative gradient error <= 1e-12 against the resident state without checkpointing."""
    model = _model(family)
    group = random_group(300, [5, 1, 9], seed=3)
    for plan in ("detach", "exact"):
        model.zero_grad()
        backward_group(model, group, plan=plan, chunk_size=13, micro_batch=2)
        reference = grads(model).clone()
        for checkpoint in ("none", "layers") if plan == "exact" else ("layers",):
            model.zero_grad()
            result = backward_group(model, group, plan=plan, chunk_size=13, micro_batch=2, checkpoint=checkpoint,
                                    offload_state=True)
            assert result.stats["offload_state"] is True
            assert_close(f"grads(model) {(plan, checkpoint)}", reference, grads(model), SAME_ORDER_F64)


def test_offloaded_state_is_read_through_copies():
    """Every read of an offloaded state is a fresh differentiable copy (even on the CPU), so gradients reach the
    host-side leaves through the copy; a resident state hands out its own tensors."""
    model = _model("qwen3_next-A")
    ids = torch.arange(40)
    resident = capture_prompt(model, ids, chunk_size=16)
    offloaded = capture_prompt(model, ids, chunk_size=16, offload=True).as_leaves()
    assert resident.device is None and offloaded.device == torch.device("cpu")
    assert resident.nbytes() == offloaded.nbytes()
    layer = next(i for i in range(offloaded.num_layers) if offloaded.attention_chunks(i))
    (_, k_res, _), (_, k_off, _) = resident.attention_chunks(layer)[0], offloaded.attention_chunks(layer)[0]
    # resident: no copy, one view of the layer's tensor over the whole prefix (`PromptState._slab`)
    assert k_res.data_ptr() == resident.keys[layer][0].data_ptr() and k_res.shape[2] == resident.length
    c = offloaded.keys[layer][0].shape[2]
    assert k_off.data_ptr() != offloaded.keys[layer][0].data_ptr() and torch.equal(k_off, k_res[:, :, :c])
    k_off.sum().backward()
    assert offloaded.keys[layer][0].grad is not None
    recurrent = next(i for i in range(offloaded.num_layers) if offloaded.last("recurrent", i) is not None)
    assert offloaded.last("recurrent", recurrent).data_ptr() != offloaded.parts["recurrent"][recurrent][-1].data_ptr()


def test_a_given_prompt_state_is_offloaded(tiny_llama64):
    """A state captured by the sampler (resident) is moved to host memory when offload_state is asked for."""
    group = random_group(30, [4, 6])
    state = capture_prompt(tiny_llama64, group.prompt[:-1], chunk_size=8)
    assert state.offload(torch.device("cpu")).device == torch.device("cpu")
    tiny_llama64.zero_grad()
    backward_group(tiny_llama64, group, plan="exact", chunk_size=8)
    reference = grads(tiny_llama64).clone()
    tiny_llama64.zero_grad()
    backward_group(tiny_llama64, group, plan="exact", chunk_size=8, prompt_state=state, offload_state=True)
    assert_close('grads(tiny_llama64)', reference, grads(tiny_llama64), SAME_ORDER_F64)


def test_offload_is_refused_for_the_standard_plans(tiny_llama64):
    with pytest.raises(ValueError, match="has none; use plan detach or exact"):
        backward_group(tiny_llama64, random_group(10, [3]), plan="standard", offload_state=True)


def test_offloaded_state_keeps_one_layer_on_the_device(monkeypatch):
    """The term the offload lever changes, measured on the CPU: the bytes of state copies alive at once on the
    compute side (every `fetch`, tracked until freed). With per-layer checkpointing it stays at one layer's K/V
    (plus the chunk gradients the prompt backward brings over), as the planner's on-device forecast says; without
    checkpointing every layer's copy is saved for the backward, as the planner says."""
    import weakref

    from transformers import AutoModelForCausalLM, LlamaConfig

    from longstraw import planner
    from longstraw.engine.state.prompt import PromptState

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    group = random_group(200, [6, 9, 4], seed=1, dtype=torch.float32)
    live, peak = [0], [0]
    fetch = PromptState.fetch

    def counting(self, t):
        out = fetch(self, t)
        if out is not None and out is not t:
            size = out.numel() * out.element_size()
            live[0] += size
            peak[0] = max(peak[0], live[0])
            weakref.finalize(out, lambda: live.__setitem__(0, live[0] - size))
        return out

    monkeypatch.setattr(PromptState, "fetch", counting)
    spec = planner.spec_from_config(model.config)
    measured = {}
    for checkpoint in ("layers", "none"):
        peak[0] = 0
        backward_group(model, group, plan="exact", chunk_size=16, checkpoint=checkpoint, offload_state=True)
        measured[checkpoint] = peak[0]
    parts = planner.state_parts(spec, 199, 4, 16, exact=True)
    whole, one_layer = parts.attention, parts.largest_layer
    assert whole == 8 * one_layer
    # one layer's K/V copies, plus (prompt backward) one chunk's K/V gradients of every layer: a fifth of the
    # 8-layer state, not all of it
    assert one_layer <= measured["layers"] <= one_layer + whole * 16 // 199 + 1024, (measured, one_layer)
    inp = planner.PlanInputs(prompt_tokens=200, response_tokens=9, group_size=3, dtype="fp32", chunk_size=16,
                             device="cpu", optimizer="none", checkpoint_layers=True, offload_state=True)
    forecast = planner.estimate(spec, inp, "exact").components
    assert abs(forecast["prompt_state"] / measured["layers"] - 1) <= 0.05, (forecast["prompt_state"], measured)
    # (The copies' gradients, the planner's on-device `state_gradients` under offload, are one layer's: the
    # attention backward returns all chunk gradients of its layer together. Hooks see each one only as it goes
    # back to the host, so they are not measured here.)
    assert measured["none"] >= whole  # every layer's copy alive for the backward: no saving without checkpointing
    # Prefetch (on by default on a GPU; forced on here): the next attention layer's copies are made while a layer
    # computes, so one more layer is on the device, as the planner's GPU forecast counts.
    from longstraw.engine.state import prompt as prompt_module

    monkeypatch.setattr(prompt_module, "_prefetch_by_default", lambda device: device is not None)
    peak[0] = 0
    backward_group(model, group, plan="exact", chunk_size=16, checkpoint="layers", offload_state=True)
    on_gpu = planner.estimate(spec, replace(inp, device="cuda"), "exact").components
    assert on_gpu["prompt_state"] > forecast["prompt_state"]
    assert abs(on_gpu["prompt_state"] / peak[0] - 1) <= 0.05, (on_gpu["prompt_state"], peak[0], measured)


@pytest.mark.parametrize("family", ("llama", "gemma3-A", "qwen3_next-A", "deepseek_v3"))
def test_prefetched_reads_give_the_same_gradient(family, monkeypatch):
    """Prefetch (on by default on CUDA) forced on for the CPU: the next attention layer's copies are made when a
    layer reads its own, up the layers in a forward and down them in a checkpointed backward's recomputes. Same
    gradients as without (float64, <= 1e-12), and reads are served from the prefetched copies."""
    from longstraw.engine.state import prompt as prompt_module

    model = _model(family)
    group = random_group(200, [5, 9], seed=4)
    probe = capture_prompt(model, torch.arange(20), chunk_size=16)
    attention_layers = sum(any(k is not None for k in probe.keys[i]) for i in range(probe.num_layers))
    model.zero_grad()
    backward_group(model, group, plan="exact", chunk_size=16, micro_batch=1)
    reference = grads(model).clone()

    served = []
    take = prompt_module._Prefetched.take

    def counting_take(self):
        served.append(len(self.chunks))
        return take(self)

    monkeypatch.setattr(prompt_module, "_prefetch_by_default", lambda device: device is not None)
    monkeypatch.setattr(prompt_module._Prefetched, "take", counting_take)
    for plan in ("detach", "exact"):
        for checkpoint in ("none", "layers"):
            model.zero_grad()
            served.clear()
            backward_group(model, group, plan=plan, chunk_size=16, micro_batch=1, checkpoint=checkpoint,
                           offload_state=True)
            if plan == "exact":
                assert_close(f"grads(model) {(plan, checkpoint)}", reference, grads(model), SAME_ORDER_F64)
            if attention_layers >= 2:  # with one attention layer there is nothing to read ahead
                assert served, f"{plan}/{checkpoint}: no read was served from a prefetched copy"


def test_prefetch_holds_at_most_one_layer_ahead_and_follows_the_direction():
    """Reads up the layers prefetch the next attention layer above, reads down the one below; one entry at most."""
    from longstraw.engine.state.prompt import PromptState

    n = 5
    state = PromptState(num_layers=n, device=torch.device("cpu"), prefetch=True)
    for start in (0, 4):
        state.append_chunk(start, start + 4, {layer: {"key": torch.randn(1, 1, 4, 2), "value": torch.randn(1, 1, 4, 2)}
                                              for layer in range(n)})
    state = state.as_leaves()
    state.attention_chunks(0)
    assert state._ahead is not None and state._ahead.layer == 1
    state.attention_chunks(1)
    assert state._ahead is not None and state._ahead.layer == 2
    state.attention_chunks(n - 1)  # a jump up: the top layer has nothing above it
    assert state._ahead is None
    state.attention_chunks(n - 2)  # reading down (a checkpointed backward): the layer below comes next
    assert state._ahead is not None and state._ahead.layer == n - 3
    with torch.no_grad():  # a copy made under grad mode is not served to a no-grad read (and vice versa)
        chunks = state.attention_chunks(n - 3)
    assert all(not k.requires_grad for _, k, _ in chunks)
