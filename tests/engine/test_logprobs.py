"""Chunked log-probs against full logits: values and gradients, float64."""

import pytest
import torch

from longstraw.engine.logprobs import (
    chunked_logprobs,
    masked_logprobs_reference,
    naive_logprobs,
    selected_logprobs,
)


@pytest.mark.parametrize("token_chunk", [1, 3, 7, 100])
def test_chunked_logprobs_match_full_logits(token_chunk):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 7, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (2, 7), generator=gen)
    upstream = torch.randn(2, 7, generator=gen, dtype=torch.float64)
    fast = chunked_logprobs(hidden, weight, targets, token_chunk)
    ref = naive_logprobs(hidden, weight, targets)
    assert fast.shape == (2, 7)
    assert (fast - ref).abs().max() < 1e-13
    g_fast = torch.autograd.grad((fast * upstream).sum(), [hidden, weight])
    g_ref = torch.autograd.grad((ref * upstream).sum(), [hidden, weight])
    for a, r in zip(g_fast, g_ref):
        assert (a - r).abs().max() < 1e-12


def test_chunked_logprobs_never_saves_full_logits():
    """Only hidden, weight and targets are kept for backward: nothing of size N x V."""
    hidden = torch.randn(64, 8, requires_grad=True)
    weight = torch.randn(1000, 8, requires_grad=True)
    targets = torch.randint(0, 1000, (64,))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        chunked_logprobs(hidden, weight, targets, token_chunk=16)
    assert saved and max(saved) <= 1000 * 8


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_chunked_logprobs_at_a_temperature(temperature):
    """log_softmax(logits / T): values and gradients against the full-logit reference (TRL scores at T)."""
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(9, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (9,), generator=gen)
    fast = chunked_logprobs(hidden, weight, targets, 4, temperature=temperature)
    ref = torch.log_softmax(hidden @ weight.t() / temperature, -1).gather(-1, targets[:, None]).squeeze(-1)
    assert (fast - ref).abs().max() < 1e-13
    assert (fast - chunked_logprobs(hidden, weight, targets, 4)).abs().max() > 1e-3  # T really changes them
    grads_fast = torch.autograd.grad(fast.sum(), [hidden, weight])
    for a, r in zip(grads_fast, torch.autograd.grad(ref.sum(), [hidden, weight])):
        assert (a - r).abs().max() < 1e-12


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_with_a_logit_scale(temperature):
    """Cohere2's forward returns lm_head(h) * logit_scale: log_softmax(h @ W.T * s / T), values and gradients, against
    the full-logit reference, and the naive reference agrees."""
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(9, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (9,), generator=gen)
    fast = chunked_logprobs(hidden, weight, targets, 4, temperature=temperature, logit_scale=0.0625)
    logits = hidden @ weight.t() * 0.0625 / temperature
    ref = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    assert (fast - ref).abs().max() < 1e-13
    assert (naive_logprobs(hidden, weight, targets, temperature, logit_scale=0.0625) - ref).abs().max() < 1e-13
    unscaled = chunked_logprobs(hidden, weight, targets, 4, temperature=temperature)
    assert (fast - unscaled).abs().max() > 1e-1  # the scale really changes them
    grads_fast = torch.autograd.grad(fast.sum(), [hidden, weight])
    for a, r in zip(grads_fast, torch.autograd.grad(ref.sum(), [hidden, weight])):
        assert (a - r).abs().max() < 1e-12


def test_bfloat16_logprobs_accumulate_in_float32():
    """precision.py: a bf16 model's log-probs come out in fp32 (log-sum-exp over the vocabulary in fp32), equal to
    the fp32 reference on the same bf16 logits, and the gradients reach hidden and weight in bf16."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=gen).to(torch.bfloat16).requires_grad_(True)
    weight = torch.randn(300, 16, generator=gen).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, 300, (37,), generator=gen)
    logp = chunked_logprobs(hidden, weight, targets, token_chunk=8)
    assert logp.dtype == torch.float32
    logits = (hidden.detach() @ weight.detach().t()).float()  # the bf16 product, then fp32 from there on
    ref = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    assert (logp.detach() - ref).abs().max() < 1e-5
    d_h, d_w = torch.autograd.grad(logp.sum(), [hidden, weight])
    assert d_h.dtype == d_w.dtype == torch.bfloat16
    h64, w64 = hidden.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
    r_h, r_w = torch.autograd.grad(naive_logprobs(h64, w64, targets).sum(), [h64, w64])
    assert (d_h.double() - r_h).norm() / r_h.norm() < 1e-2 and (d_w.double() - r_w).norm() / r_w.norm() < 1e-2


@pytest.mark.parametrize("token_chunk", [1, 4, 100])
def test_selected_logprobs_match_the_reference(token_chunk):
    """Log-probs of the kept rows only: values and gradients equal full logits' (float64), the placeholder
    elsewhere, and no gradient reaches a skipped row's hidden state."""
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 7, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (2, 7), generator=gen)
    keep = torch.rand(2, 7, generator=gen) < 0.6
    upstream = torch.randn(2, 7, generator=gen, dtype=torch.float64)
    fast = selected_logprobs(hidden, weight, targets, keep, token_chunk, temperature=0.8, logit_scale=1.5)
    ref = masked_logprobs_reference(hidden, weight, targets, keep, temperature=0.8, logit_scale=1.5)
    assert fast.shape == (2, 7) and bool((fast[~keep] == 0).all())
    assert (fast - ref).abs().max() < 1e-13
    g_fast = torch.autograd.grad((fast * upstream).sum(), [hidden, weight])
    g_ref = torch.autograd.grad((ref * upstream).sum(), [hidden, weight])
    for a, r in zip(g_fast, g_ref):
        assert (a - r).abs().max() < 1e-12
    assert bool((g_fast[0][~keep] == 0).all())


def _capped_reference(hidden, weight, targets, softcap, temperature=1.0, logit_scale=1.0):
    """transformers' Gemma-2 order, written out: projection (* factor), / cap, tanh, * cap, then / T."""
    logits = hidden @ weight.t() * logit_scale
    logits = torch.tanh(logits / softcap) * softcap / temperature
    return torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)


@pytest.mark.parametrize("token_chunk", [1, 4, 100])
@pytest.mark.parametrize("temperature,logit_scale", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.0625), (1.3, 2.0)])
def test_chunked_logprobs_with_a_final_logit_softcap(token_chunk, temperature, logit_scale):
    """Gemma-2's final_logit_softcapping (30): log_softmax(cap * tanh(h @ W.T * s / cap) / T), values and gradients of
    hidden and weight against the written-out reference, float64. The logits are scaled so that many of them reach
    tanh's curved part (|x| ~ cap), where a missing or misplaced cap shows."""
    gen = torch.Generator().manual_seed(3)
    hidden = (6.0 * torch.randn(2, 9, 16, generator=gen, dtype=torch.float64)).requires_grad_(True)
    weight = (2.0 * torch.randn(50, 16, generator=gen, dtype=torch.float64)).requires_grad_(True)
    targets = torch.randint(0, 50, (2, 9), generator=gen)
    upstream = torch.randn(2, 9, generator=gen, dtype=torch.float64)
    cap = 30.0 * logit_scale  # the scaled logits reach the cap's curved part at every factor
    fast = chunked_logprobs(hidden, weight, targets, token_chunk, temperature, logit_scale, softcap=cap)
    ref = _capped_reference(hidden, weight, targets, cap, temperature, logit_scale)
    assert (fast - ref).abs().max() < 1e-12
    assert (naive_logprobs(hidden, weight, targets, temperature, logit_scale, softcap=cap) - ref).abs().max() < 1e-12
    uncapped = chunked_logprobs(hidden, weight, targets, token_chunk, temperature, logit_scale)
    assert (fast - uncapped).abs().max() > 1.0  # the cap really changes them
    g_fast = torch.autograd.grad((fast * upstream).sum(), [hidden, weight])
    g_ref = torch.autograd.grad((ref * upstream).sum(), [hidden, weight])
    for a, r in zip(g_fast, g_ref):
        assert (a - r).abs().max() / r.abs().max() < 1e-12


def test_selected_logprobs_with_a_softcap():
    gen = torch.Generator().manual_seed(4)
    hidden = (6.0 * torch.randn(2, 7, 16, generator=gen, dtype=torch.float64)).requires_grad_(True)
    weight = (2.0 * torch.randn(50, 16, generator=gen, dtype=torch.float64)).requires_grad_(True)
    targets = torch.randint(0, 50, (2, 7), generator=gen)
    keep = torch.rand(2, 7, generator=gen) < 0.6
    fast = selected_logprobs(hidden, weight, targets, keep, 3, temperature=0.8, softcap=30.0)
    ref = masked_logprobs_reference(hidden, weight, targets, keep, temperature=0.8, softcap=30.0)
    assert (fast - ref).abs().max() < 1e-12
    g_fast, g_ref = torch.autograd.grad(fast.sum(), [hidden, weight]), torch.autograd.grad(ref.sum(), [hidden, weight])
    for a, r in zip(g_fast, g_ref):
        assert (a - r).abs().max() / r.abs().max() < 1e-12


def test_gradcheck_softcapped_logprobs():
    gen = torch.Generator().manual_seed(5)
    hidden = (3.0 * torch.randn(5, 4, generator=gen, dtype=torch.float64)).requires_grad_(True)
    weight = torch.randn(7, 4, generator=gen, dtype=torch.float64).requires_grad_(True)
    targets = torch.randint(0, 7, (5,), generator=gen)
    fn = lambda h, w: chunked_logprobs(h, w, targets, 2, 0.9, 1.5, softcap=2.0)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (hidden, weight))


@pytest.mark.parametrize("softcap", [0.0, -30.0])
def test_a_softcap_must_be_positive(softcap):
    gen = torch.Generator().manual_seed(6)
    with pytest.raises(ValueError, match="final_logit_softcapping must be > 0"):
        chunked_logprobs(torch.randn(3, 4, generator=gen), torch.randn(5, 4, generator=gen), torch.zeros(3).long(),
                         softcap=softcap)


@pytest.mark.parametrize("token_chunk", [3, 64])
def test_output_projection_bias_matches_naive_with_gradients(token_chunk):
    """An output projection with a bias (Phi-2, CodeGen, GPT-J): values and the gradients of hidden, weight and bias
    equal the reference in float64, with a logit factor and a soft-cap on top; without the bias they differ."""
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(11, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(40, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = (3 * torch.randn(40, generator=gen, dtype=torch.float64)).requires_grad_(True)
    targets = torch.randint(0, 40, (11,), generator=gen)
    fast = chunked_logprobs(hidden, weight, targets, token_chunk, 0.8, 0.5, softcap=4.0, bias=bias)
    ref = naive_logprobs(hidden, weight, targets, 0.8, 0.5, 4.0, bias=bias)
    assert float((fast - ref).abs().max()) <= 1e-12
    weights = torch.linspace(-1, 1, 11, dtype=torch.float64)
    g_fast = torch.autograd.grad((fast * weights).sum(), (hidden, weight, bias))
    g_ref = torch.autograd.grad((ref * weights).sum(), (hidden, weight, bias))
    for a, b in zip(g_fast, g_ref):
        assert float((a - b).norm() / b.norm()) <= 1e-12
    unbiased = chunked_logprobs(hidden, weight, targets, token_chunk, 0.8, 0.5, softcap=4.0)
    assert float((unbiased - ref).abs().max()) > 1e-2
