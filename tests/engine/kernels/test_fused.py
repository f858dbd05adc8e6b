"""The fused-op glue of `attention_fused` on CPU: everything of the CUDA paths except the CUDA kernels themselves.

* The CUDA ops are emulated with the CPU flash op, which computes the same thing (forward: out and log-sum-exp;
  backward: the flash backward given out and lse). The emulations assert the rules the CUDA ops impose — head dim
  a multiple of 8 (flash also <= 256), q/k/v/out/grad_out all of one width, the efficient op's log-sum-exp padded
  to a multiple of 32 rows (its pad filled with NaN here, so an unsliced use poisons the result) — so the padding,
  the log-sum-exp gradient fold and the slicing are checked against the naive reference in float64.
* The calls are checked against the real ops' schemas and output shapes on the meta device.
* The kernel choice per device, dtype and head dim, the run-time refusal fallback (logged once) and that an
  out-of-memory error is not swallowed.
tests/gpu/ runs the real CUDA kernels where a GPU is present.
"""

from __future__ import annotations

import logging
import types

import pytest
import torch
from helpers import assert_bfloat16_close_to_float64

import longstraw.engine.kernels.attention as attention
import longstraw.engine.kernels.fused as fused
from longstraw.engine.kernels.attention import naive_attention, prefix_attention
from longstraw.engine.kernels.fused import choose_kernel, fused_backward, fused_forward, round_up

pytestmark = pytest.mark.skipif(fused._FLASH_CPU is None, reason="this torch build has no fused CPU flash op")


def _check_widths(*ts: torch.Tensor, flash: bool) -> None:
    width = ts[0].shape[-1]
    assert all(t.shape[-1] == width for t in ts), [t.shape for t in ts]
    assert width % 8 == 0, f"head dim {width} is not a multiple of 8"
    assert not flash or width <= 256
    assert all(t.dim() == 4 and t.stride(-1) == 1 for t in ts)
    assert all(s % 8 == 0 for t in ts for s in t.stride()[:-1]), "strides aligned as the efficient op needs"


def _rng() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64)


def fake_flash(q, k, v, dropout_p, is_causal, return_debug_mask, *, scale):
    assert dropout_p == 0.0 and not return_debug_mask
    _check_widths(q, k, v, flash=True)
    out, lse = fused._FLASH_CPU(q, k, v, 0.0, is_causal, scale=scale)
    return (out, lse, None, None, q.shape[2], k.shape[2], *_rng(), torch.empty(0))


def fake_flash_bwd(grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset,
                   *, scale):
    assert cum_q is None and cum_k is None and (max_q, max_k) == (q.shape[2], k.shape[2]) and dropout_p == 0.0
    assert seed.dtype == torch.uint64 and lse.shape == q.shape[:3]
    _check_widths(grad_out, q, k, v, out, flash=True)
    return fused._FLASH_CPU_BWD(grad_out, q, k, v, out, lse, 0.0, is_causal, scale=scale)


def fake_efficient(q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal, *, scale):
    assert attn_bias is None and compute_log_sumexp and dropout_p == 0.0
    _check_widths(q, k, v, flash=False)
    out, lse = fused._FLASH_CPU(q, k, v, 0.0, is_causal, scale=scale)
    m = q.shape[2]
    padded = torch.full((*lse.shape[:-1], round_up(m, 32)), float("nan"), dtype=lse.dtype)
    padded[..., :m] = lse
    return out, padded, torch.tensor(0), torch.tensor(0)


def fake_efficient_bwd(grad_out, q, k, v, attn_bias, out, lse, seed, offset, dropout_p, grad_input_mask, is_causal,
                       *, scale):
    m = q.shape[2]
    assert attn_bias is None and dropout_p == 0.0 and list(grad_input_mask) == [True, True, True, False]
    assert lse.shape[-1] == round_up(m, 32), "the efficient op reads its own padded log-sum-exp layout"
    _check_widths(grad_out, q, k, v, out, flash=False)
    dq, dk, dv = fused._FLASH_CPU_BWD(grad_out, q, k, v, out, lse[..., :m], 0.0, is_causal, scale=scale)
    return dq, dk, dv, None


@pytest.fixture
def emulated_cuda(monkeypatch):
    """Route ChunkAttention through an emulated CUDA kernel on CPU tensors; the test picks which."""
    monkeypatch.setattr(fused, "_FLASH_CUDA", fake_flash)
    monkeypatch.setattr(fused, "_FLASH_CUDA_BWD", fake_flash_bwd)
    monkeypatch.setattr(fused, "_EFFICIENT_CUDA", fake_efficient)
    monkeypatch.setattr(fused, "_EFFICIENT_CUDA_BWD", fake_efficient_bwd)
    monkeypatch.setattr(fused, "_logged", set())
    monkeypatch.setattr(fused, "_refusals", set())

    def use(kernel: str) -> None:
        monkeypatch.setattr(attention, "choose_kernel", lambda q, enabled=True: kernel)

    return use


def _inputs(b, h, hkv, t, chunks, d, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(True)  # noqa: E731
    return (mk(b, h, t, d), mk(b, hkv, t, d), mk(b, hkv, t, d), [mk(1, hkv, c, d) for c in chunks],
            [mk(1, hkv, c, d) for c in chunks])


@pytest.mark.parametrize("kernel", ["cuda_flash", "cuda_efficient"])
@pytest.mark.parametrize("d", [8, 16, 20, 64, 72])  # 8/64: the backward pads D + 1 to D + 8; 20: forward pads too
@pytest.mark.parametrize("chunks", [[], [5], [3, 11, 7]])
def test_emulated_cuda_kernels_match_naive_with_every_gradient(emulated_cuda, kernel, d, chunks):
    emulated_cuda(kernel)
    q, k, v, pk, pv = _inputs(2, 4, 2, 9, chunks, d)
    inputs = [q, k, v, *pk, *pv]
    weight = torch.randn(2, 4, 9, d, dtype=torch.float64)
    fast, ref = prefix_attention(q, k, v, pk, pv, 0.3), naive_attention(q, k, v, pk, pv, 0.3)
    assert (fast - ref).abs().max() < 1e-13
    g_fast = torch.autograd.grad((fast * weight).sum(), inputs)
    g_ref = torch.autograd.grad((ref * weight).sum(), inputs)
    for a, r in zip(g_fast, g_ref):
        assert (a - r).abs().max() < 1e-12


@pytest.mark.parametrize("kernel", ["cuda_flash", "cuda_efficient"])
def test_state_chunks_are_read_in_place(emulated_cuda, monkeypatch, kernel):
    """The state's chunks are transposed views (last dim dense): a head dim that needs no padding reaches the op
    as the same storage, no copy per call (decoding reads every chunk at every step)."""
    emulated_cuda(kernel)
    seen = []
    op = "_FLASH_CUDA" if kernel == "cuda_flash" else "_EFFICIENT_CUDA"
    real = getattr(fused, op)
    monkeypatch.setattr(fused, op, lambda q, k, v, *a, **kw: (seen.append(k.data_ptr()), real(q, k, v, *a, **kw))[1])
    k = torch.randn(1, 40, 2, 16, dtype=torch.float64).transpose(1, 2)  # (1, Hkv, c, D), not contiguous
    v = torch.randn(1, 40, 2, 16, dtype=torch.float64).transpose(1, 2)
    q = torch.randn(2, 5, 16, dtype=torch.float64)
    out, _, _ = fused_forward(kernel, q, k, v, 0.25, False)
    assert seen == [k.data_ptr()]
    ref = torch.softmax(q @ k[0].transpose(-1, -2) * 0.25, -1) @ v[0]
    assert (out - ref).abs().max() < 1e-13


@pytest.mark.parametrize("kernel", ["cuda_flash", "cuda_efficient"])
def test_emulated_cuda_log_sum_exp_gradient(emulated_cuda, kernel):
    """The merge differentiates the log-sum-exp; check its gradient alone (out's gradient zero) and together."""
    emulated_cuda(kernel)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    kv = [torch.randn(1, 2, c, 12, generator=gen, dtype=torch.float64, requires_grad=True) for c in (4, 9, 4, 9)]
    w_out, w_lse = torch.randn(2, 6, 12, dtype=torch.float64), torch.randn(2, 6, dtype=torch.float64)

    def reference(q, k1, k2, v1, v2):
        k, v = torch.cat([k1, k2], -2)[0], torch.cat([v1, v2], -2)[0]
        s = q @ k.transpose(-1, -2) * 0.4
        return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)

    for a_out in (0.0, 1.0):
        out, lse = attention.ChunkAttention.apply(q, 0.4, False, 2, *kv)
        r_out, r_lse = reference(q, *kv)
        assert (out - r_out).abs().max() < 1e-13 and (lse - r_lse).abs().max() < 1e-13
        g = torch.autograd.grad((a_out * out * w_out).sum() + (lse * w_lse).sum(), [q, *kv])
        g_ref = torch.autograd.grad((a_out * r_out * w_out).sum() + (r_lse * w_lse).sum(), [q, *kv])
        for x, y in zip(g, g_ref):
            assert (x - y).abs().max() < 1e-12


@pytest.mark.parametrize("kernel", ["cuda_flash", "cuda_efficient"])
def test_emulated_cuda_kernels_in_bfloat16(emulated_cuda, kernel):
    """bf16 through the padded CUDA layout stays within bf16 rounding of float64 (merges in fp32)."""
    emulated_cuda(kernel)
    assert_bfloat16_close_to_float64(d=16)


@pytest.mark.parametrize("kernel,dtype", [("cuda_flash", torch.bfloat16), ("cuda_flash", torch.float16),
                                          ("cuda_efficient", torch.float32), ("cuda_efficient", torch.bfloat16)])
@pytest.mark.parametrize("d", [64, 72, 20])
def test_calls_match_the_real_ops_schemas_on_meta(kernel, dtype, d):
    """The real CUDA ops (their meta kernels) accept our calls; shapes and dtypes come out as we slice them."""
    n, m, c = 3, 37, 50
    q = torch.empty(n, m, d, device="meta", dtype=dtype)
    k = v = torch.empty(1, n, c, d, device="meta", dtype=dtype)
    out, lse, aux = fused_forward(kernel, q, k, v, 0.1, False)
    assert out.shape == (n, m, d) and out.dtype == dtype
    assert lse.shape == (n, m) and lse.dtype == torch.float32
    causal_out, _, _ = fused_forward(kernel, torch.empty(n, c, d, device="meta", dtype=dtype), k, v, 0.1, True)
    assert causal_out.shape == (n, c, d)
    dq, dk, dv = fused_backward(kernel, torch.empty_like(out), torch.empty_like(lse), q, k, v, out, lse, 0.1, False,
                                aux)
    assert dq.shape == (n, m, d) and dk.shape == dv.shape == (n, c, d) and dq.dtype == dtype


def _like(device: str, dtype: torch.dtype, d: int):
    return types.SimpleNamespace(device=torch.device(device), dtype=dtype, shape=(2, 5, d))


@pytest.mark.parametrize("device,dtype,d,expected", [
    ("cpu", torch.float64, 64, "cpu_flash"),
    ("cuda", torch.bfloat16, 64, "cuda_flash"),
    ("cuda", torch.float16, 128, "cuda_flash"),
    ("cuda", torch.bfloat16, 248, "cuda_flash"),       # backward width 256
    ("cuda", torch.bfloat16, 256, "cuda_efficient"),   # backward width 264 > flash's 256
    ("cuda", torch.float32, 64, "cuda_efficient"),
    ("cuda", torch.float64, 64, "portable"),
    ("mps", torch.float32, 64, "portable"),
])
def test_kernel_choice(device, dtype, d, expected):
    assert choose_kernel(_like(device, dtype, d)) == expected  # type: ignore[arg-type]
    assert choose_kernel(_like(device, dtype, d), enabled=False) == "portable"  # type: ignore[arg-type]


def test_portable_on_cuda_is_logged_once(monkeypatch, caplog):
    monkeypatch.setattr(fused, "_logged", set())
    with caplog.at_level(logging.WARNING, logger="longstraw.engine.kernels.fused"):
        for _ in range(3):
            choose_kernel(_like("cuda", torch.float64, 64))  # type: ignore[arg-type]
    assert len(caplog.records) == 1 and "float64" in caplog.text and "portable" in caplog.text


def test_refusing_op_falls_back_to_portable_logged_once(emulated_cuda, monkeypatch, caplog):
    emulated_cuda("cuda_flash")

    def refuse(*args, **kwargs):
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")

    monkeypatch.setattr(fused, "_FLASH_CUDA", refuse)
    q, k, v, pk, pv = _inputs(1, 4, 2, 6, [4, 4], 16)
    with caplog.at_level(logging.WARNING, logger="longstraw.engine.kernels.fused"):
        for _ in range(2):
            fast = prefix_attention(q, k, v, pk, pv, 0.3)
            g = torch.autograd.grad(fast.sum(), [q, *pk])
    ref = naive_attention(q, k, v, pk, pv, 0.3)
    assert (fast - ref).abs().max() < 1e-13
    for a, r in zip(g, torch.autograd.grad(ref.sum(), [q, *pk])):
        assert (a - r).abs().max() < 1e-12
    assert len(caplog.records) == 1 and "Ampere" in caplog.text and "portable" in caplog.text


def test_a_refusal_routes_later_calls_past_the_op(monkeypatch):
    """After flash refused bf16 at a head dim on CUDA, the choice for it is the memory-efficient op (then, after
    that refuses too, the portable kernel) without trying the refusing op again; other head dims are unaffected."""
    monkeypatch.setattr(fused, "_refusals", set())
    monkeypatch.setattr(fused, "_logged", set())
    q = _like("cuda", torch.bfloat16, 64)
    fused.refused("cuda_flash", q, RuntimeError("no"))  # type: ignore[arg-type]
    assert choose_kernel(q) == "cuda_efficient"  # type: ignore[arg-type]
    fused.refused("cuda_efficient", q, RuntimeError("no"), "backward")  # type: ignore[arg-type]
    assert choose_kernel(q) == "portable"  # type: ignore[arg-type]
    assert choose_kernel(_like("cuda", torch.bfloat16, 128)) == "cuda_flash"  # type: ignore[arg-type]


def test_refusing_backward_falls_back_to_portable(emulated_cuda, monkeypatch):
    emulated_cuda("cuda_efficient")
    monkeypatch.setattr(fused, "_EFFICIENT_CUDA_BWD", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no")))
    q, k, v, pk, pv = _inputs(1, 4, 2, 6, [4, 3], 8)
    g = torch.autograd.grad(prefix_attention(q, k, v, pk, pv, 0.3).sum(), [q, k, *pk, *pv])
    ref = naive_attention(q, k, v, pk, pv, 0.3).sum()
    for a, r in zip(g, torch.autograd.grad(ref, [q, k, *pk, *pv])):
        assert (a - r).abs().max() < 1e-12


def test_out_of_memory_is_not_swallowed(emulated_cuda, monkeypatch):
    emulated_cuda("cuda_flash")

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")

    monkeypatch.setattr(fused, "_FLASH_CUDA", oom)
    q, k, v, pk, pv = _inputs(1, 4, 2, 6, [4], 8)
    with pytest.raises(torch.OutOfMemoryError):
        prefix_attention(q, k, v, pk, pv, 0.3)


def _chunk_reference(q, k, v, scale):
    """softmax(q Kᵀ · scale) V and its log-sum-exp over one chunk: q (N, M, D), k/v (1, N, c, D)."""
    s = q @ k[0].transpose(-1, -2) * scale
    return torch.softmax(s, -1) @ v[0], torch.logsumexp(s, -1)


@pytest.mark.parametrize("zero_row", [False, True])
@pytest.mark.parametrize("lse_weight", [0.0, 1.0])
@pytest.mark.parametrize("piece_keys", [16384, 4])
def test_cpu_backward_folds_the_lse_gradient_at_the_head_dim(monkeypatch, zero_row, lse_weight, piece_keys):
    """On CPU the log-sum-exp gradient is folded into out at D (no extra column) where it can be, once per call however
    many backward pieces the keys take; a row with dLSE ≠ 0 and dO = 0 cannot be folded and takes the appended column.
    Both against the plain reference, float64."""
    widths, folds = [], []
    real, real_fold = fused._FLASH_CPU_BWD, attention.fold_lse_gradient
    monkeypatch.setattr(fused, "_FLASH_CPU_BWD",
                        lambda g, q, *a, **kw: (widths.append(q.shape[-1]), real(g, q, *a, **kw))[1])
    monkeypatch.setattr(attention, "fold_lse_gradient", lambda *a: (folds.append(1), real_fold(*a))[1])
    monkeypatch.setattr(attention, "BACKWARD_KEYS", piece_keys)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 6, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, 9, 12, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w_out, w_lse = torch.randn(2, 6, 12, dtype=torch.float64), lse_weight * torch.randn(2, 6, dtype=torch.float64)
    if zero_row:
        w_out[1, 3] = 0.0
        w_lse[1, 3] = 1.0
    out, lse = attention.ChunkAttention.apply(q, 0.4, False, 1, k, v)
    r_out, r_lse = _chunk_reference(q, k, v, 0.4)
    g = torch.autograd.grad((out * w_out).sum() + (lse * w_lse).sum(), [q, k, v])
    g_ref = torch.autograd.grad((r_out * w_out).sum() + (r_lse * w_lse).sum(), [q, k, v])
    for x, y in zip(g, g_ref):
        assert (x - y).abs().max() < 1e-12
    assert widths == [13 if zero_row else 12] * (1 if piece_keys > 9 else 3)
    assert len(folds) == 1


def test_fold_in_float32_matches_float64():
    """The fold formed in float32 (no float64 temporaries) keeps the gradient to float32's rounding."""
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(2, 6, 12, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 40, 12, generator=gen, dtype=torch.float64) for _ in range(2))
    w_out, w_lse = torch.randn(2, 6, 12, dtype=torch.float64), 3.0 * torch.randn(2, 6, dtype=torch.float64)
    grads = []
    for dtype in (torch.float32, torch.float64):
        xs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out, lse = attention.ChunkAttention.apply(xs[0], 0.4, False, 1, xs[1], xs[2])
        grads.append(torch.autograd.grad((out * w_out.to(dtype)).sum() + (lse * w_lse.to(dtype)).sum(), xs))
    for x, y in zip(*grads):
        assert ((x.double() - y).abs().max() / y.abs().max()) < 1e-5


def test_fold_is_refused_in_half_precision():
    d_out, out = torch.randn(2, 3, 8, dtype=torch.bfloat16), torch.randn(2, 3, 8, dtype=torch.bfloat16)
    assert fused.fold_lse_gradient(d_out, out, torch.ones(2, 3)) is None
    assert fused.fold_lse_gradient(d_out.float(), out.float(), torch.zeros(2, 3)) is not None


@pytest.mark.parametrize("query_tile", [2**18, 24])  # 24: several row tiles, one ragged, beside the ragged key blocks
def test_cpu_state_without_grad_takes_the_query_only_backward(monkeypatch, query_tile):
    """A prompt state without grad (detach) gets dq alone in tiles, never the flash backward (which forms dk/dv too);
    dq equals the plain reference in float64, with own tokens beside the prefix."""
    monkeypatch.setattr(attention, "KEY_BLOCK", 4)
    monkeypatch.setattr(attention, "QUERY_TILE", query_tile)
    monkeypatch.setattr(attention, "query_backward_fits", lambda: True)
    calls = []
    real = fused._FLASH_CPU_BWD
    monkeypatch.setattr(fused, "_FLASH_CPU_BWD",
                        lambda g, q, k, *a, **kw: (calls.append(k.shape[2]), real(g, q, k, *a, **kw))[1])
    q, k, v, pk, pv = _inputs(2, 4, 2, 6, [5, 11], 8)
    pk, pv = [t.detach() for t in pk], [t.detach() for t in pv]
    weight = torch.randn(2, 4, 6, 8, dtype=torch.float64)
    fast = prefix_attention(q, k, v, pk, pv, 0.3)
    ref = naive_attention(q, k, v, pk, pv, 0.3)
    g = torch.autograd.grad((fast * weight).sum(), [q, k, v])
    g_ref = torch.autograd.grad((ref * weight).sum(), [q, k, v])
    for x, y in zip(g, g_ref):
        assert (x - y).abs().max() < 1e-12
    assert calls == [6], "only the own tokens' causal chunk goes to the flash backward"


def test_query_only_backward_in_float32_against_float64():
    """The tiles in float32 (the benches' dtype): dq within float32's rounding of the float64 result."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, s, 16, generator=gen, dtype=torch.float64) for s in (40, 300, 300))
    d_out = torch.randn(2, 40, 16, generator=gen, dtype=torch.float64)
    s = q @ k.transpose(-1, -2) * 0.25
    lse = torch.logsumexp(s, -1)
    row = (d_out * (torch.softmax(s, -1) @ v)).sum(-1)
    exact = attention._query_backward(d_out, row, q, k, v, lse, 0.25)
    single = attention._query_backward(*(t.float() for t in (d_out, row, q, k, v, lse)), 0.25)
    assert (single.double() - exact).abs().max() < 1e-5 * exact.abs().max()


@pytest.mark.parametrize(("threads", "policy", "fits"), [(1, "PASSIVE", True), (2, "PASSIVE", False),
                                                         (2, "passive", False), (2, "ACTIVE", True), (2, None, True)])
def test_query_only_backward_only_where_threads_spin(monkeypatch, threads, policy, fits):
    """Two threads under PASSIVE keep the flash backward (each small op would wake the sleeping threads)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    if policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    assert attention.query_backward_fits() is fits


def test_query_only_backward_of_an_empty_chunk_is_zero():
    q, d_out = torch.randn(2, 5, 8, dtype=torch.float64), torch.randn(2, 5, 8, dtype=torch.float64)
    k = v = torch.empty(2, 0, 8, dtype=torch.float64)
    dq = attention._query_backward(d_out, torch.zeros(2, 5, dtype=torch.float64), q, k, v, torch.zeros(2, 5), 0.3)
    assert dq.shape == q.shape and not dq.any()
