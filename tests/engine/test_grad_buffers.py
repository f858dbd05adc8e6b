"""A walk's (V, d) gradients (engine/grad_buffers.py): the row-gradient embedding equals nn.Embedding's, a buffer
still referenced is never reused, a detach walk allocates the head's gradient once, and the gradients stay equal to
the walk's without either (detach) and to the standard plan's (exact), float64, tied and untied weights."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close, grads, tiny_model

from longstraw import Group, backward_group
from longstraw.engine import grad_buffers
from longstraw.engine.grad_buffers import GradBuffers, row_grad_embedding


@pytest.mark.parametrize("accumulated", [False, True])
def test_the_row_gradient_embedding_equals_nn_embeddings(accumulated):
    """Repeated ids and the padding row (its gradient 0), float64, against nn.Embedding's own backward: dense into
    a weight without `.grad`, sparse rows added in place into one that has it."""
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(11, 5, padding_idx=3).double()
    ids = torch.tensor([[1, 3, 1, 7], [3, 0, 10, 1]])
    upstream = torch.randn(2, 4, 5, dtype=torch.float64)
    before = torch.randn(11, 5, dtype=torch.float64) if accumulated else None
    embedding.weight.grad = None if before is None else before.clone()
    embedding(ids).backward(upstream)
    expected = embedding.weight.grad.clone()
    embedding.weight.grad = None if before is None else before.clone()
    held = embedding.weight.grad
    with row_grad_embedding(embedding):
        out = embedding(ids)
    assert out.grad_fn is not None and "RowGradEmbedding" in type(out.grad_fn).__name__
    out.backward(upstream)
    got = embedding.weight.grad
    assert got.layout == torch.strided and torch.allclose(got, expected, rtol=0, atol=1e-15)
    assert float((got - (0 if before is None else before))[3].abs().max()) == 0
    if accumulated:
        assert got is held  # added in place, no (V, d) tensor of its own


def test_a_referenced_buffer_is_not_reused():
    weight = torch.zeros(4, 3, requires_grad=True)
    buffers = GradBuffers()
    first = buffers.take(weight).fill_(1.0)
    buffers.give(weight, first)
    held = first.view(-1)  # someone else (autograd's input buffer, a hook) still holds it
    second = buffers.take(weight)
    assert second.data_ptr() != first.data_ptr() and float(held.sum()) == 12
    buffers.give(weight, second)
    del held, first
    third = buffers.take(weight)  # `second`: the pool's only reference now
    assert third.data_ptr() == second.data_ptr() and buffers.allocated == 2


def test_a_weight_with_a_hook_gets_a_fresh_tensor():
    weight = torch.zeros(4, 3, requires_grad=True)
    weight.register_hook(lambda g: g)
    buffers = GradBuffers()
    buffers.give(weight, buffers.take(weight))
    assert not grad_buffers.eligible(weight) and buffers.take(weight).data_ptr() and buffers.allocated == 2


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("plan", ["detach", "exact"])
def test_a_group_walk_allocates_its_gradients_once(monkeypatch, plan, tied):
    """G = 4 responses: a detach walk allocates the head's (V, d) gradient once; the gradients equal the walk's with
    a fresh dense gradient per backward (detach) or the standard plan's (exact)."""
    model = tiny_model("llama")
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    made: list[GradBuffers] = []
    takes = []
    init, take = GradBuffers.__init__, GradBuffers.take

    def counted_init(self) -> None:
        init(self)
        made.append(self)

    def counted_take(self, weight: torch.Tensor) -> torch.Tensor:
        takes.append(weight.shape)
        return take(self, weight)

    monkeypatch.setattr(GradBuffers, "__init__", counted_init)
    monkeypatch.setattr(GradBuffers, "take", counted_take)
    torch.manual_seed(1)
    vocab = model.config.vocab_size
    group = Group(prompt=torch.randint(0, vocab, (13,)), responses=[torch.randint(0, vocab, (5,)) for _ in range(4)],
                  advantages=torch.tensor([1.0, -0.5, 0.25, -1.0], dtype=torch.float64))
    model.zero_grad(set_to_none=True)
    with monkeypatch.context() as no_pool:  # every weight a fresh gradient: the walk without buffers
        no_pool.setattr(grad_buffers, "eligible", lambda weight: False)
        backward_group(model, group, plan="standard" if plan == "exact" else plan, chunk_size=6)
    reference = grads(model)
    made.clear()
    takes.clear()
    model.zero_grad(set_to_none=True)
    backward_group(model, group, plan=plan, chunk_size=6)
    assert_close(f"{plan} gradients", reference, grads(model), 1e-12)
    if plan == "exact":
        assert not made  # no head buffer in the exact plan
        return
    (walk_buffers,) = made
    assert len(takes) == len(group.responses) and walk_buffers.allocated == 1
