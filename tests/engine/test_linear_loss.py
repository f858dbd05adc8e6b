"""The fused linear-and-loss pass against its reference (`selected_logprobs`, the loss, autograd): values, log-probs
and the gradients of the hidden states, the weight and the bias, float64, for every loss, with masks, old and
reference log-probs, the KL term, logit scale, soft-cap, temperature, bias and blocks smaller than the rows."""

import pytest
import torch

from longstraw.engine.grad_buffers import GradBuffers
from longstraw.engine.linear_loss import linear_loss
from longstraw.engine.logprobs import selected_logprobs
from longstraw.engine.loss.config import LossConfig
from longstraw.engine.loss.kinds import LOSS_KINDS
from longstraw.engine.loss.terms import is_token_level, token_terms

B, T, D, V = 3, 9, 12, 40


def _inputs(seed: int, bias: bool):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, D, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(V, generator=gen, dtype=torch.float64, requires_grad=True) if bias else None
    targets = torch.randint(0, V, (B, T), generator=gen)
    keep = torch.rand(B, T, generator=gen) < 0.7
    keep[:, 0] = True  # every row has a kept position
    old = torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.3 - 3.0
    ref = torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.3 - 3.0
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    return hidden, weight, b, targets, keep, old, ref, adv


def _loss_of(cfg, keep, old, ref, adv):
    def loss_of(logp):
        return (token_terms(logp, keep, adv, cfg, old, ref).sum(-1) * torch.tensor([0.5, 1.0, 2.0],
                                                                                  dtype=logp.dtype)).sum()
    return loss_of


def _compare(cfg, token_chunk=4, temperature=1.0, logit_scale=1.0, softcap=None, bias=False, seed=0):
    hidden, weight, b, targets, keep, old, ref, adv = _inputs(seed, bias)
    loss_of = _loss_of(cfg, keep, old, ref, adv)
    params = [hidden, weight] + ([b] if b is not None else [])
    head = dict(temperature=temperature, logit_scale=logit_scale, softcap=softcap, bias=b)
    logp_ref = selected_logprobs(hidden, weight, targets, keep, token_chunk, **head)
    value_ref = loss_of(logp_ref)
    grads_ref = torch.autograd.grad(value_ref, params)
    value, logp = linear_loss(hidden, weight, targets, keep, loss_of, is_token_level(cfg), token_chunk, **head)
    grads = torch.autograd.grad(value, params)
    assert not logp.requires_grad
    assert _close(logp, logp_ref.detach())
    assert _close(value.detach(), value_ref.detach())
    for name, g, r in zip(("hidden", "weight", "bias"), grads, grads_ref):
        assert _close(g, r), name
        assert r.abs().max() > 0, name  # the gradient is not trivially zero


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Within 1e-12 of b's largest magnitude (or absolutely, below 1): the softmax is formed two ways (exp(x − max)
    over its sum here, exp(x − lse) in the reference), equal to the last bits."""
    return float((a - b).abs().max()) <= 1e-12 * max(1.0, float(b.abs().max()))


@pytest.mark.parametrize(("kind", "beta"), [(kind, beta) for kind in sorted(LOSS_KINDS) for beta in (0.0, 0.05)
                                             if not (beta and LOSS_KINDS[kind].supervised)])  # nll: no KL term
def test_every_loss_equals_the_reference(kind, beta):
    _compare(LossConfig(kind, beta=beta))


@pytest.mark.parametrize("sequence_ratio", [False, True])
def test_the_sequence_ratio_and_the_kl_ratio(sequence_ratio):
    _compare(LossConfig("grpo", beta=0.04, kl_ratio=True, sequence_ratio=sequence_ratio, delta=3.0,
                        log_ratio_clamp=(-5.0, 5.0)))


@pytest.mark.parametrize("token_chunk", [1, 4, 27, 1024])
@pytest.mark.parametrize("head", [dict(temperature=0.7), dict(logit_scale=0.25), dict(softcap=3.0),
                                  dict(temperature=1.3, logit_scale=2.0, softcap=5.0, bias=True)])
def test_the_head_options_and_blocks(token_chunk, head):
    _compare(LossConfig("dapo", beta=0.02), token_chunk=token_chunk, **head)
    _compare(LossConfig("gspo"), token_chunk=token_chunk, **head)


def test_the_gradient_scales_with_the_incoming_one():
    hidden, weight, _, targets, keep, old, ref, adv = _inputs(1, False)
    loss_of = _loss_of(LossConfig("grpo"), keep, old, ref, adv)
    value, _ = linear_loss(hidden, weight, targets, keep, loss_of, True, 4)
    (value * 3.0).backward()
    once = [hidden.grad.clone(), weight.grad.clone()]
    hidden.grad = weight.grad = None
    ref_value = loss_of(selected_logprobs(hidden, weight, targets, keep, 4))
    (ref_value * 3.0).backward()
    assert _close(once[0], hidden.grad) and _close(once[1], weight.grad)


def test_no_term_and_no_grad():
    hidden, weight, _, targets, keep, *_ = _inputs(2, False)
    value, logp = linear_loss(hidden, weight, targets, keep, lambda lp: None, True, 4)
    assert value is None
    assert _close(logp, selected_logprobs(hidden, weight, targets, keep, 4).detach())
    with torch.no_grad():
        value, logp2 = linear_loss(hidden, weight, targets, keep, lambda lp: lp.sum(), True, 4)
    assert abs(float(value) - float(logp.sum())) < 1e-12


def test_the_logits_are_formed_once_per_block(monkeypatch):
    """A token-level loss forms each kept row's logits once (forward only); the reference forms them twice."""
    import longstraw.engine.logits as logits
    import longstraw.engine.logprobs as logprobs

    hidden, weight, _, targets, keep, old, ref, adv = _inputs(3, False)
    loss_of = _loss_of(LossConfig("grpo"), keep, old, ref, adv)
    formed = []
    product = logprobs.accumulated_product

    def counted(h, w, b=None):
        formed.append(h.shape[0])
        return product(h, w, b)

    monkeypatch.setattr(logprobs, "accumulated_product", counted)  # the reference's forward
    monkeypatch.setattr(logits, "accumulated_product", counted)  # every scored block
    linear_loss(hidden, weight, targets, keep, loss_of, True, 4)[0].backward()
    fused, formed[:] = sum(formed), []
    loss_of(selected_logprobs(hidden, weight, targets, keep, 4)).backward()
    assert fused == int(keep.sum())
    assert sum(formed) == 2 * int(keep.sum())


@pytest.mark.parametrize("token_level", [True, False])
def test_one_block_of_logits_is_alive_at_a_time(monkeypatch, token_level):
    """The pass frees each block's (c, V) logits (softmax, gradient, in place) before forming the next: when a block's
    product is formed, no earlier block's is still referenced (two alive at once doubled the replay's log-prob peak)."""
    import weakref

    import longstraw.engine.logits as logits

    hidden, weight, _, targets, keep, old, ref, adv = _inputs(3, False)
    loss_of = _loss_of(LossConfig("grpo"), keep, old, ref, adv)
    earlier: list[weakref.ref] = []
    alive_at_formation = []
    product = logits.accumulated_product

    def tracked(h, w, b=None):
        alive_at_formation.append(sum(r() is not None for r in earlier))
        out = product(h, w, b)
        earlier.append(weakref.ref(out))
        return out

    monkeypatch.setattr(logits, "accumulated_product", tracked)
    linear_loss(hidden, weight, targets, keep, loss_of, token_level, 4)[0].backward()
    assert len(alive_at_formation) >= 3 and alive_at_formation == [0] * len(alive_at_formation)


@pytest.mark.parametrize("token_level", [True, False])
def test_no_kept_row_gives_zero_weight_and_bias_gradients(token_level):
    """The first block writes the weight's and bias's gradients (no zero fill); with no kept row no block runs, and
    they are zero, not whatever the reused buffer or fresh memory held."""
    hidden, weight, b, targets, keep, old, ref, adv = _inputs(0, True)
    buffers = GradBuffers()
    stale = buffers.take(weight).fill_(7.0)
    buffers.give(weight, stale)
    del stale
    nothing = torch.zeros_like(keep)
    value, _ = linear_loss(hidden, weight, targets, nothing, lambda logp: (logp * 2.0).sum(), token_level,
                           bias=b, buffers=buffers)
    g_weight, g_bias = torch.autograd.grad(value, [weight, b], allow_unused=True)
    assert float(g_weight.abs().max()) == 0 and float(g_bias.abs().max()) == 0
