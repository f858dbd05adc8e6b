"""Mamba-1's selective scan (`kernels/selective_scan.py`): the chunked fast path equals the sequential reference, a
scan continued from the state of a first part equals one scan of the whole (outputs, final states and gradients,
those of the initial state included), the reference equals transformers' own scan from a zero state, and the
shared initial state is never written."""

from __future__ import annotations

import pytest
import torch
from helpers import EXACT_F64, assert_close
from transformers.models.mamba.modeling_mamba import mamba_selective_scan

from longstraw.engine.kernels.selective_scan import naive_selective_scan, selective_scan

D_INNER, N = 12, 5


def _inputs(batch: int, length: int, seed: int = 0, dtype=torch.float64) -> dict[str, torch.Tensor]:
    """Leaves of a Mamba-1 scan: u, dt, z (b, d, T); B, C (b, T, N); A_log (d, N); D, dt_bias (d,)."""
    gen = torch.Generator().manual_seed(seed)

    def mk(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale + shift).to(dtype).requires_grad_()

    return dict(u=mk(batch, D_INNER, length), dt=mk(batch, D_INNER, length, scale=0.5, shift=-1.0),
                z=mk(batch, D_INNER, length), B=mk(batch, length, N), C=mk(batch, length, N),
                A_log=mk(D_INNER, N, scale=0.3, shift=0.5), D=mk(D_INNER), dt_bias=mk(D_INNER, scale=0.2))


def _run(scan, x: dict[str, torch.Tensor], initial_state=None, sl=slice(None), wide=torch.float32, **kw):
    """The scan over positions `sl` with transformers' float32 casts (`wide` float32), or none (float64)."""
    A = -torch.exp(x["A_log"].to(wide))
    return scan(x["u"][..., sl], x["dt"][..., sl], A, x["B"][:, sl], x["C"][:, sl], D=x["D"].to(wide),
                z=x["z"][..., sl], dt_bias=x["dt_bias"].to(wide), initial_state=initial_state, upcast=wide, **kw)


def _grads(outputs: tuple[torch.Tensor, ...], leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    loss = sum((o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() for o in outputs)
    return list(torch.autograd.grad(loss, leaves, allow_unused=True))


@pytest.mark.parametrize("length", [1, 7, 16, 41])
@pytest.mark.parametrize("chunk", [1, 4, 16])
def test_fast_path_equals_the_reference(length, chunk):
    """Outputs, final state and every gradient (the initial state's included), a (1, d, N) initial state shared by a
    batch of 3, float64."""
    x = _inputs(3, length)
    h0 = torch.randn(1, D_INNER, N, generator=torch.Generator().manual_seed(2), dtype=torch.float64).requires_grad_()
    leaves = [*x.values(), h0]
    ref = _run(naive_selective_scan, x, h0)
    got = _run(selective_scan, x, h0, chunk=chunk)
    for name, r, g in zip(("y", "state"), ref, got):
        assert g.shape == r.shape and g.dtype == r.dtype
        assert_close(name, r, g, EXACT_F64)
    for leaf, r, g in zip(("u", "dt", "z", "B", "C", "A_log", "D", "dt_bias", "h0"), _grads(ref, leaves),
                          _grads(got, leaves)):
        assert_close(f"d{leaf}", r, g, EXACT_F64)


@pytest.mark.parametrize("scan", [naive_selective_scan, selective_scan])
def test_a_continued_scan_equals_one_scan_of_the_whole(scan):
    """[0, 23) then [23, 50) from the first part's final state equals [0, 50) at once, outputs and gradients; the
    gradient reaching the first part through its final state is what the exact plan's prompt backward carries."""
    x = _inputs(2, 50, seed=3)
    leaves = list(x.values())
    wide = torch.float64  # without transformers' float32 casts, which round the gradients passing through them
    whole = _run(scan, x, wide=wide)
    y1, h1 = _run(scan, x, sl=slice(0, 23), wide=wide)
    y2, h2 = _run(scan, x, initial_state=h1, sl=slice(23, 50), wide=wide)
    assert_close("y", whole[0], torch.cat([y1, y2], -1), EXACT_F64)
    assert_close("state", whole[1], h2, EXACT_F64)
    for r, g in zip(_grads(whole, leaves), _grads((torch.cat([y1, y2], -1), h2), leaves)):
        assert_close("grad", r, g, EXACT_F64)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_the_reference_is_transformers_scan_from_a_zero_state(dtype):
    """With no initial state both compute transformers' `mamba_selective_scan` with its casts: the outputs in its
    dtype, the state in float32 (float64 for a float64 model)."""
    x = _inputs(2, 19, seed=4, dtype=dtype)
    A = -torch.exp(x["A_log"].float())
    with torch.no_grad():
        ref_y, ref_h = mamba_selective_scan(x["u"], x["dt"], A, x["B"].transpose(1, 2), x["C"].transpose(1, 2),
                                            D=x["D"].float(), z=x["z"], delta_bias=x["dt_bias"].float(),
                                            delta_softplus=True, return_last_state=True)
        for scan in (naive_selective_scan, selective_scan):
            y, h = _run(scan, x)
            assert y.dtype == ref_y.dtype and h.dtype == ref_h.dtype
            tol = EXACT_F64 if dtype == torch.float64 else 1e-5 if dtype == torch.float32 else 1e-2
            assert_close("y", ref_y.double(), y.double(), tol)
            assert_close("state", ref_h.double(), h.double(), tol)


def test_the_initial_state_is_never_written():
    x = _inputs(2, 9, seed=5)
    h0 = torch.randn(1, D_INNER, N, dtype=torch.float64)
    before, version = h0.clone(), h0._version
    for scan in (naive_selective_scan, selective_scan):
        with torch.no_grad():
            _run(scan, x, h0)
    assert torch.equal(h0, before) and h0._version == version


def test_a_chunk_below_one_is_refused():
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        _run(selective_scan, _inputs(1, 4), chunk=0)
