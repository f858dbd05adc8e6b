"""On a CUDA device (marked `gpu`; collected everywhere, skipped without CUDA): the fused CUDA attention kernels
against the portable kernel and the naive float64 reference, the exact plan against standard in bf16, sampling
against a full forward.

Tolerances (relative error in the norm, against float64 on the same inputs unless said otherwise):
* attention outputs, log-sum-exps and every gradient: fp32 2e-3 (the CUDA ops may use TF32-class math
  internally), fp16 5e-3, bf16 3e-2, for the fused and the portable kernel alike (the portable kernel upcasts to
  fp32 and is nearly exact on the rounded inputs; a fused bf16 kernel rounds its softmax weights to bf16 before
  the product with V, as every flash kernel does: 2e-3 on CPU's);
* exact vs standard parameter gradient: bf16 5e-2 (both against fp32 standard and against each other, the bound
  the CPU suite uses for bf16), fp32 1e-3;
* sampled log-probs vs a full forward of the same model: fp32 1e-3, bf16 0.1 (bf16 forward noise on log-probs
  of about -6; the sampler's log-probs are fp32, precision.py).

`LONGSTRAW_GPU_TESTS_DEVICE=cpu` runs them on CPU (the fused kernel is then the CPU flash op): a dry run of the
tests' own logic on a host without a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import BF16, assert_close, grads, random_group, rel_err, tiny_model

import longstraw.engine.kernels.attention as attention
from longstraw import Group, backward_group
from longstraw.engine.kernels.fused import choose_kernel
from longstraw.engine.sampling import SamplingConfig, sample_group

pytestmark = pytest.mark.gpu
DEVICE_ENV = "LONGSTRAW_GPU_TESTS_DEVICE"
ATTENTION_TOL = {torch.float32: 2e-3, torch.float16: 5e-3, torch.bfloat16: 3e-2}


@pytest.fixture
def device() -> torch.device:
    forced = os.environ.get(DEVICE_ENV)
    if forced:
        return torch.device(forced)
    if not torch.cuda.is_available():
        pytest.skip(f"needs a CUDA device (set {DEVICE_ENV}=cpu to dry-run the test logic on CPU)")
    return torch.device("cuda")


def _attention_case(device, dtype, d, causal, seed=0):
    """q (N, M, D) and key/value chunks (1, N, c, D) on the device in dtype, plus float64 copies on CPU."""
    gen = torch.Generator().manual_seed(seed)
    n = 4
    chunks = [200] if causal else [300, 1024, 77]
    m = 200 if causal else 96
    q = torch.randn(n, m, d, generator=gen, dtype=torch.float64)
    ks = [torch.randn(1, n, c, d, generator=gen, dtype=torch.float64) for c in chunks]
    vs = [torch.randn(1, n, c, d, generator=gen, dtype=torch.float64) for c in chunks]
    w_out = torch.randn(n, m, d, generator=gen, dtype=torch.float64)
    w_lse = torch.randn(n, m, generator=gen, dtype=torch.float64)
    low = [t.to(device=device, dtype=dtype).requires_grad_(True) for t in (q, *ks, *vs)]
    ref = [t.to(dtype).double().requires_grad_(True) for t in (q, *ks, *vs)]  # same rounded inputs, fp64
    return low, ref, len(chunks), w_out, w_lse


def _chunk_attention(inputs, n, scale, causal, w_out, w_lse):
    q, *kv = inputs
    out, lse = attention.ChunkAttention.apply(q, scale, causal, n, *kv)
    loss = (out.double() * w_out.to(out.device)).sum() + (lse.double() * w_lse.to(lse.device)).sum()
    return [out, lse, *torch.autograd.grad(loss, inputs)]


def _naive(inputs, n, scale, causal, w_out, w_lse):
    q, *kv = inputs
    k, v = torch.cat(kv[:n], dim=-2)[0], torch.cat(kv[n:], dim=-2)[0]
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    out, lse = torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)
    loss = (out * w_out).sum() + (lse * w_lse).sum()
    return [out, lse, *torch.autograd.grad(loss, inputs)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("d", [64, 128, 72])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_kernel_matches_portable_and_naive(device, monkeypatch, dtype, d, causal):
    low, ref, n, w_out, w_lse = _attention_case(device, dtype, d, causal)
    assert choose_kernel(low[0]) != "portable", "the fused kernel must be the one taken on this device"
    scale = d ** -0.5
    fused = _chunk_attention(low, n, scale, causal, w_out, w_lse)
    monkeypatch.setattr(attention, "USE_FUSED", False)
    portable = _chunk_attention(low, n, scale, causal, w_out, w_lse)
    naive = _naive(ref, n, scale, causal, w_out, w_lse)
    names = ["out", "lse", "dq"] + [f"dk{j}" for j in range(n)] + [f"dv{j}" for j in range(n)]
    for name, f, p, r in zip(names, fused, portable, naive):
        err_f, err_p = rel_err(f.detach().double().cpu(), r.detach()), rel_err(p.detach().double().cpu(), r.detach())
        assert err_f < ATTENTION_TOL[dtype] and err_p < ATTENTION_TOL[dtype], (name, err_f, err_p)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_next-A"])
def test_exact_equals_standard_gradient_in_bfloat16(device, family):
    reference = tiny_model(family, dtype=torch.float32).to(device)
    group = random_group(300, [40, 25, 33, 12], seed=3, dtype=torch.float32)
    reference.zero_grad(set_to_none=True)
    backward_group(reference, group, plan="standard")
    g_ref = grads(reference)
    reference.zero_grad(set_to_none=True)
    backward_group(reference, group, plan="exact", chunk_size=64, micro_batch=2)
    assert_close("grads(reference)", g_ref, grads(reference), 1e-3)  # fp32 on the device
    low = tiny_model(family, dtype=torch.float32)
    low.load_state_dict(reference.state_dict())
    low = low.to(device=device, dtype=torch.bfloat16)
    results = {}
    for plan in ("standard", "exact"):
        low.zero_grad(set_to_none=True)
        backward_group(low, group, plan=plan, chunk_size=64, micro_batch=2)
        results[plan] = grads(low).float()
    assert_close('results["exact"]', g_ref, results["exact"], BF16)
    assert_close('results["standard"]', g_ref, results["standard"], BF16)
    assert_close('results["exact"]', results["standard"], results["exact"], BF16)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-3), (torch.bfloat16, 0.1)], ids=["fp32", "bf16"])
def test_sampled_logprobs_equal_a_full_forward(device, dtype, tol):
    model = tiny_model("llama", dtype=dtype).to(device)
    prompt = torch.randint(0, 512, (300,), generator=torch.Generator().manual_seed(0))
    out = sample_group(model, prompt, 4, SamplingConfig(max_new_tokens=16), seed=1, chunk_size=64)
    prompt = prompt.to(device)
    for resp, lp in zip(out.responses, out.logprobs):
        assert lp.dtype == torch.float32 and resp.numel() == 16
        with torch.no_grad():
            ids = torch.cat([prompt, resp])[None]
            logits = model(input_ids=ids).logits[0, prompt.numel() - 1 : -1].float()
            full = torch.log_softmax(logits, -1).gather(1, resp[:, None]).squeeze(1)
        assert (lp - full).abs().max() < tol


def test_group_on_the_device_trains_end_to_end(device):
    """One bf16 exact step with the state on the device: finite loss and gradient, log-probs in fp32."""
    model = tiny_model("llama", dtype=torch.bfloat16).to(device)
    group = random_group(500, [30, 20], seed=4, dtype=torch.float32)
    result = backward_group(model, Group(group.prompt, group.responses, group.advantages), plan="exact",
                            chunk_size=128)
    g = grads(model)
    assert result.skipped is None and torch.isfinite(g).all() and float(g.abs().max()) > 0
    assert all(lp.dtype == torch.float32 for lp in result.logprobs)
