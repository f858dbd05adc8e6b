"""The exact plan's kept capture graphs (`backward_group(keep_prompt_graph=N)`, `engine/backprop.py`)."""

from __future__ import annotations

import pytest
import torch
from helpers import SAME_ORDER_F64, assert_close, gradient_tolerance, grads, random_group, tiny_model

from longstraw import backward_group
from longstraw.engine import backprop
from longstraw.engine.tree import plans as exact_plan

_MODELS: dict[str, torch.nn.Module] = {}


def _model(family: str) -> torch.nn.Module:
    if family not in _MODELS:
        _MODELS[family] = tiny_model(family)
    return _MODELS[family]


def _count_recomputes(monkeypatch) -> list[int]:
    """Prompt-backward recomputes (run_segment calls from backprop.py), by chunk start."""
    starts: list[int] = []
    run = backprop.run_segment

    def counted(model, ids, start, *args, **kwargs):
        starts.append(start)
        return run(model, ids, start, *args, **kwargs)

    monkeypatch.setattr(backprop, "run_segment", counted)
    return starts


# Attention, sliding window + full, gated DeltaNet hybrid (recurrent state at the boundaries), MLA latent, Mamba2.
@pytest.mark.parametrize("family", ("llama", "gemma3-A", "qwen3_next-A", "deepseek_v3", "mamba2"))
def test_kept_graphs_give_the_same_gradient(family, monkeypatch):
    """float64: every N (none kept, the last chunk, two, all and more than all) gives the gradient of N = 0 (itself
    the plain transformers forward's, `standard`, within `gradient_tolerance`) within 1e-12 relative, with and
    without per-layer checkpointing and with the offloaded state; a kept chunk is not recomputed, the others are."""
    model = _model(family)
    group = random_group(70, [5, 1, 9], seed=5)  # prompt[:-1] = 69 tokens: chunks of 16 -> 5 chunks (the last 5)
    model.zero_grad()
    backward_group(model, group, plan="standard")  # the plain transformers forward of each prompt + response
    plain = grads(model).clone()
    model.zero_grad()
    backward_group(model, group, plan="exact", chunk_size=16, micro_batch=2)
    reference = grads(model).clone()
    assert_close(f"reference {family}", plain, reference, gradient_tolerance(family))
    starts = _count_recomputes(monkeypatch)
    for checkpoint, offload in (("none", False), ("layers", False), ("layers", True)):
        for keep in (1, 2, 5, 9):
            model.zero_grad()
            starts.clear()
            result = backward_group(model, group, plan="exact", chunk_size=16, micro_batch=2, checkpoint=checkpoint,
                                    offload_state=offload, keep_prompt_graph=keep)
            assert_close(f"grads(model) {(family, checkpoint, offload, keep)}", reference, grads(model), SAME_ORDER_F64)
            assert sorted(starts) == [0, 16, 32, 48, 64][: max(0, 5 - keep)], (keep, starts)
            assert result.stats["plan"] == "exact"


def test_kept_graph_is_released_after_its_backward():
    """No kept graph outlives the call: after backward_group, nothing references the capture's activations (the
    state, its graphs and the kept outputs are all gone: a weak reference to a kept output dies)."""
    import weakref

    model = _model("llama")
    group = random_group(70, [5, 9], seed=6)
    seen: list[weakref.ref] = []
    original = exact_plan.prompt_backward

    def spying(model_, ids, leaves, **kwargs):
        seen.extend(weakref.ref(t) for outs in leaves.graphs.values() for t in outs if t is not None)
        return original(model_, ids, leaves, **kwargs)

    exact_plan.prompt_backward = spying  # what `exact` calls
    try:
        backward_group(model, group, plan="exact", chunk_size=16, keep_prompt_graph=2)
    finally:
        exact_plan.prompt_backward = original
    assert seen, "no kept graph reached the prompt backward"
    assert all(ref() is None for ref in seen)


@pytest.mark.parametrize("kwargs, message", [
    (dict(plan="detach", keep_prompt_graph=1), "the detach plan has none"),
    (dict(plan="standard", keep_prompt_graph=1), "the standard plan has none"),
    (dict(plan="exact", keep_prompt_graph=-1), "integer >= 0"),
    (dict(plan="exact", keep_prompt_graph=True), "integer >= 0"),
    (dict(plan="exact", keep_prompt_graph=1.5), "integer >= 0"),
])
def test_keep_prompt_graph_refuses_what_it_cannot_do(kwargs, message):
    model = _model("llama")
    group = random_group(40, [3, 4], seed=1)
    model.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match=message):
        backward_group(model, group, chunk_size=16, **kwargs)
    assert all(p.grad is None for p in model.parameters())  # refused before any gradient


def test_keep_prompt_graph_with_a_given_state_is_refused():
    from longstraw.engine.state.capture import capture_prompt

    model = _model("llama")
    group = random_group(40, [3, 4], seed=1)
    state = capture_prompt(model, group.prompt[:-1], chunk_size=16)
    with pytest.raises(ValueError, match="pass one or the other"):
        backward_group(model, group, plan="exact", chunk_size=16, prompt_state=state, keep_prompt_graph=1)



@pytest.mark.parametrize("keep", (0, 2))
def test_exact_plan_reads_its_prefix_in_one_run_per_layer(keep, monkeypatch):
    """The exact plan's leaves are views of one tensor per layer (`PromptState._slab`): the replays and the prompt
    backward's recomputes read the prompt chunks before them as one run per layer (one kernel call), kept capture
    graphs or not. The gradient is unchanged (the float64 tests above)."""
    import longstraw.engine.kernels.attention as attention

    model = _model("llama")
    group = random_group(70, [5, 9], seed=5)  # prompt[:-1] = 69 tokens: chunks of 16 -> 5 chunks
    seen: list[tuple[int, int]] = []  # (chunks read, runs) per ChunkAttention call over a prefix
    recomputes: list[tuple[int, int]] = []  # the same, during the prompt backward's recomputes
    real_runs, real_segment = attention.adjacent_runs, backprop.run_segment

    def counted(keys, values):
        runs = real_runs(keys, values)
        seen.append((len(keys), len(runs)))
        return runs

    def recompute(*args, **kwargs):
        before = len(seen)
        out = real_segment(*args, **kwargs)
        recomputes.extend(seen[before:])
        return out

    monkeypatch.setattr(attention, "adjacent_runs", counted)
    monkeypatch.setattr(backprop, "run_segment", recompute)
    backward_group(model, group, plan="exact", chunk_size=16, micro_batch=2, keep_prompt_graph=keep)
    replays = [runs for chunks, runs in seen if chunks == 5]  # responses against the whole prompt
    assert replays and set(replays) == {1}
    # chunk c's recompute reads chunks 0 ... c-1 (c = 1 ... 4 - keep; chunk 0 reads none) as one run
    assert sorted(set(recomputes)) == [(c, 1) for c in range(1, 5 - keep)]


@pytest.mark.parametrize("family", ["llama", "qwen3_next-A", "mamba2", "deepseek_v3"])
def test_frozen_embeddings_and_first_layer_train_in_every_plan(family):
    """The common recipe of freezing the embeddings and the first layer: every plan trains, and the trainable
    parameters' gradients equal the standard plan's (float64). In the exact plan the first layer's recomputed K/V
    then have no trainable path: the prompt backward stops there instead of failing."""
    gradients = {}
    for plan in ("standard", "detach", "exact"):
        model = tiny_model(family)
        model.get_input_embeddings().requires_grad_(False)
        model.base_model.layers[0].requires_grad_(False)
        group = random_group(24, [5, 7, 3], seed=3)
        backward_group(model, group, plan=plan, chunk_size=8)
        trainable = [p for p in model.parameters() if p.requires_grad]
        assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
        gradients[plan] = torch.cat([p.grad.flatten() for p in trainable])
    assert gradients["standard"].norm() > 0
    assert_close(f"{family} exact", gradients["standard"], gradients["exact"], gradient_tolerance(family))
    assert (gradients["detach"] - gradients["standard"]).norm() > 0  # detach's bias: the prompt state is constant
