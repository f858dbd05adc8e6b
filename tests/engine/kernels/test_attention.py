"""The prefix-attention kernel against its plain reference: outputs and gradients, float64."""

import pytest
import torch
from helpers import assert_bfloat16_close_to_float64, attention_inputs

import longstraw.engine.kernels.attention as attention
import longstraw.engine.kernels.fused as fused
from longstraw.engine.kernels.attention import naive_attention, prefix_attention


@pytest.fixture(params=["fused", "portable"])
def kernel(request, monkeypatch):
    """Run a test on the fused CPU flash path and on the portable blocked kernel."""
    if request.param == "fused" and fused._FLASH_CPU is None:
        pytest.skip("this torch build has no fused CPU flash-attention op")
    monkeypatch.setattr(attention, "USE_FUSED", request.param == "fused")
    monkeypatch.setattr(attention, "KEY_BLOCK", 4)  # several key blocks per chunk, one ragged
    return request.param


@pytest.mark.parametrize("b,h,hkv", [(1, 4, 4), (2, 4, 2), (3, 8, 1)])
@pytest.mark.parametrize("chunks", [[], [1], [3, 7], [5, 2, 11]])
def test_prefix_attention_matches_naive_with_gradients(kernel, b, h, hkv, chunks):
    q, k, v, pk, pv = attention_inputs(b, h, hkv, 9, chunks)
    inputs = [q, k, v, *pk, *pv]
    weight = torch.randn(b, h, 9, 8, dtype=torch.float64)
    fast = prefix_attention(q, k, v, pk, pv, 0.35)
    ref = naive_attention(q, k, v, pk, pv, 0.35)
    assert (fast - ref).abs().max() < 1e-13
    g_fast = torch.autograd.grad((fast * weight).sum(), inputs)
    g_ref = torch.autograd.grad((ref * weight).sum(), inputs)
    for a, r in zip(g_fast, g_ref):
        assert (a - r).abs().max() < 1e-12


def test_prefix_gradients_skip_when_state_is_constant(kernel):
    """Detach plan: the state does not require grad, the kernel must still give dq exactly."""
    q, k, v, pk, pv = attention_inputs(2, 4, 2, 6, [4, 4])
    pk = [t.detach() for t in pk]
    pv = [t.detach() for t in pv]
    out = prefix_attention(q, k, v, pk, pv, 0.3).sum()
    ref = naive_attention(q, k, v, pk, pv, 0.3).sum()
    for a, r in zip(torch.autograd.grad(out, [q, k, v]), torch.autograd.grad(ref, [q, k, v])):
        assert (a - r).abs().max() < 1e-12


def test_gradcheck_prefix_kernel(kernel):
    q, k, v, pk, pv = attention_inputs(1, 2, 1, 3, [2, 3], d=4)
    fn = lambda q, k, v, a, b, c, d: prefix_attention(q, k, v, [a, b], [c, d], 0.5)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v, *pk, *pv))


def test_fused_path_is_used_on_cpu():
    """The fast path must actually be taken where available, or the benchmarks measure the slow one."""
    q, k, v, pk, pv = attention_inputs(1, 2, 1, 3, [2])
    if fused._FLASH_CPU is None:
        pytest.skip("this torch build has no fused CPU flash-attention op")
    assert fused.choose_kernel(q) == "cpu_flash"


def test_bfloat16_stays_close_to_float64(kernel):
    assert_bfloat16_close_to_float64()


def test_adjacent_prefix_views_take_one_kernel_call(monkeypatch):
    """adjacent_runs: chunks that are adjacent views of one tensor are read with one kernel call (no copy); the
    output equals the per-chunk one; separate tensors break a run."""
    from longstraw.engine.kernels.attention import adjacent_runs

    if fused._FLASH_CPU is None:
        pytest.skip("this torch build has no fused CPU flash-attention op")
    q, k, v, pk, pv = attention_inputs(2, 4, 2, 3, [5, 7, 3, 4])
    whole_k, whole_v = torch.cat([t.detach() for t in pk], 2), torch.cat([t.detach() for t in pv], 2)
    views_k, views_v = list(whole_k.split([5, 7, 3, 4], 2)), list(whole_v.split([5, 7, 3, 4], 2))
    mixed_k = views_k[:2] + [pk[2].detach()] + views_k[3:]  # a run of two, then two singles
    mixed_v = views_v[:2] + [pv[2].detach()] + views_v[3:]
    calls = _count_kernel_calls(monkeypatch)
    q_, k_, v_ = q.detach(), k.detach(), v.detach()
    ref = naive_attention(q_, k_, v_, views_k, views_v, 0.3)
    assert (prefix_attention(q_, k_, v_, views_k, views_v, 0.3) - ref).abs().max() < 1e-13
    assert calls["forward"] == 2  # own tokens, then the whole prefix in one run
    assert (prefix_attention(q_, k_, v_, mixed_k, mixed_v, 0.3) - ref).abs().max() < 1e-13
    assert calls["forward"] == 2 + 4  # own tokens, then the prefix in three runs
    runs = adjacent_runs(views_k, views_v)
    assert len(runs) == 1 and runs[0][2] == [5, 7, 3, 4]
    assert runs[0][0].data_ptr() == whole_k.data_ptr() and runs[0][0].shape == whole_k.shape
    assert [sizes for _, _, sizes in adjacent_runs(mixed_k, mixed_v)] == [[5, 7], [3], [4]]
    assert len(adjacent_runs(pk, pv)) == 4  # separate tensors


def test_a_run_of_leaves_gives_each_chunk_its_own_gradient(monkeypatch, kernel):
    """The exact plan's leaves: one leaf per chunk, views of one coalesced tensor. One kernel call forward and one
    backward read the run, and every leaf's gradient equals the naive reference's for its chunk (float64)."""
    q, k, v, pk, pv = attention_inputs(2, 4, 2, 3, [5, 7, 3, 4])
    whole_k, whole_v = torch.cat([t.detach() for t in pk], 2), torch.cat([t.detach() for t in pv], 2)
    leaf_k = [t.detach().requires_grad_(True) for t in whole_k.split([5, 7, 3, 4], 2)]
    leaf_v = [t.detach().requires_grad_(True) for t in whole_v.split([5, 7, 3, 4], 2)]
    assert len({t.untyped_storage().data_ptr() for t in leaf_k}) == 1
    calls = _count_kernel_calls(monkeypatch)
    out = prefix_attention(q, k, v, leaf_k, leaf_v, 0.3)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype)
    (out * weights).sum().backward()
    if attention.USE_FUSED:
        assert calls == {"forward": 2, "backward": 2}  # own tokens, then the four chunks in one run
    ref = naive_attention(q, k, v, pk, pv, 0.3)
    assert (out - ref).abs().max() < 1e-13
    (ref * weights).sum().backward()
    for got, want in zip(leaf_k + leaf_v, pk + pv):
        assert got.grad is not None and got.grad.shape == want.shape
        assert (got.grad - want.grad).abs().max() < 1e-12


def _count_kernel_calls(monkeypatch) -> dict[str, int]:
    """Counts the fused op's forward and backward calls (one per run of key chunks)."""
    calls = {"forward": 0, "backward": 0}
    for name in ("forward", "backward"):
        real = getattr(attention, f"fused_{name}")

        def counted(*a, _real=real, _name=name):
            calls[_name] += 1
            return _real(*a)
        monkeypatch.setattr(attention, f"fused_{name}", counted)
    return calls


def test_a_runs_backward_goes_in_pieces_of_whole_chunks(monkeypatch, kernel):
    """BACKWARD_KEYS bounds the keys per backward call (its padded copies and gradients): a run of chunks [5, 7, 3, 4]
    with at most 8 keys per call takes pieces [5], [7], [3, 4] — three calls, one forward — and every chunk's
    gradient still equals the naive reference's (float64)."""
    from longstraw.engine.kernels.attention import _pieces

    whole = torch.arange(19.0).view(1, 1, 19, 1)
    pieces = _pieces(whole, whole, [5, 7, 3, 4], 8)
    assert [sizes for _, _, sizes in pieces] == [[5], [7], [3, 4]]
    assert [k.flatten().tolist()[0] for k, _, _ in pieces] == [0.0, 5.0, 12.0]
    assert [s for _, _, s in _pieces(whole, whole, [5, 7, 3, 4], 100)] == [[5, 7, 3, 4]]
    assert [s for _, _, s in _pieces(whole, whole, [5, 7, 3, 4], 1)] == [[5], [7], [3], [4]]
    monkeypatch.setattr(attention, "BACKWARD_KEYS", 8)
    q, k, v, pk, pv = attention_inputs(2, 4, 2, 3, [5, 7, 3, 4])
    whole_k, whole_v = torch.cat([t.detach() for t in pk], 2), torch.cat([t.detach() for t in pv], 2)
    leaf_k = [t.detach().requires_grad_(True) for t in whole_k.split([5, 7, 3, 4], 2)]
    leaf_v = [t.detach().requires_grad_(True) for t in whole_v.split([5, 7, 3, 4], 2)]
    calls = _count_kernel_calls(monkeypatch)
    out = prefix_attention(q, k, v, leaf_k, leaf_v, 0.3)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(4), dtype=out.dtype)
    (out * weights).sum().backward()
    if attention.USE_FUSED:
        assert calls == {"forward": 2, "backward": 1 + 3}  # own tokens; the prefix: one run forward, three pieces back
    q_grad = q.grad.clone()
    q.grad = None
    ref = naive_attention(q, k, v, pk, pv, 0.3)
    (ref * weights).sum().backward()
    assert (q_grad - q.grad).abs().max() < 1e-12
    for got, want in zip(leaf_k + leaf_v, pk + pv):
        assert (got.grad - want.grad).abs().max() < 1e-12


def test_one_chunk_longer_than_a_piece_goes_back_in_pieces(monkeypatch, kernel):
    """A single prefix chunk of 19 keys (a walk's path, read as one view) with at most 8 keys per backward call: three
    calls (8, 8, 3 keys), its gradient joined, equal to the naive reference's (float64)."""
    monkeypatch.setattr(attention, "BACKWARD_KEYS", 8)
    q, k, v, pk, pv = attention_inputs(2, 4, 2, 3, [19])
    calls = _count_kernel_calls(monkeypatch)
    out = prefix_attention(q, k, v, pk, pv, 0.3)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(4), dtype=out.dtype)
    (out * weights).sum().backward()
    if attention.USE_FUSED:
        assert calls == {"forward": 2, "backward": 1 + 3}
    got = [q.grad.clone(), pk[0].grad.clone(), pv[0].grad.clone()]
    for t in (q, pk[0], pv[0]):
        t.grad = None
    (naive_attention(q, k, v, pk, pv, 0.3) * weights).sum().backward()
    for a, b in zip(got, [q.grad, pk[0].grad, pv[0].grad]):
        assert (a - b).abs().max() < 1e-12


class _OneRank:
    """A context-parallel group of one rank: the sharded path's code with nothing to exchange."""

    def reduce_grad(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def merge(self, out, lse, like_out, like_lse):
        return out, lse


def _sinks(h: int, seed: int = 7) -> torch.Tensor:
    """(H,) float64 sink logits around the scores' size (gpt-oss initialises them like weights; trained ones are
    O(1)), a leaf."""
    return torch.randn(h, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).requires_grad_(True)


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("b,h,hkv", [(1, 4, 4), (2, 4, 2), (3, 8, 1)])
@pytest.mark.parametrize("chunks", [[], [3, 7]])
def test_sinks_match_naive_with_gradients(kernel, b, h, hkv, chunks, sharded):
    """Attention sinks (gpt-oss' s_aux): outputs and the gradients of every input, the sinks included, equal the
    reference that appends a sink column to the softmax; on the context-parallel path too (a group of one rank)."""
    q, k, v, pk, pv = attention_inputs(b, h, hkv, 9, chunks)
    sinks = _sinks(h)
    inputs = [q, k, v, *pk, *pv, sinks]
    weight = torch.randn(b, h, 9, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    fast = prefix_attention(q, k, v, pk, pv, 0.35, sinks=sinks, context_shards=_OneRank() if sharded else None)
    ref = naive_attention(q, k, v, pk, pv, 0.35, sinks=sinks)
    assert (fast - ref).abs().max() < 1e-13
    g_fast = torch.autograd.grad((fast * weight).sum(), inputs)
    g_ref = torch.autograd.grad((ref * weight).sum(), inputs)
    for a, r in zip(g_fast, g_ref):
        assert (a - r).abs().max() < 1e-12
    assert g_ref[-1].abs().min() > 1e-6  # every head's sink receives a gradient
    without = naive_attention(q, k, v, pk, pv, 0.35)
    assert (without - ref).abs().max() > 1e-2  # a kernel that ignored the sinks would fail the comparison


def test_sinks_while_decoding(kernel):
    """One query per sequence over the prompt and every generated token (causal=False), with sinks."""
    q, k, v, pk, pv = attention_inputs(2, 4, 2, 5, [4, 6])
    q = q[:, :, -1:].detach().requires_grad_(True)
    sinks = _sinks(4)
    fast = prefix_attention(q, k, v, pk, pv, 0.35, causal=False, sinks=sinks)
    ref = naive_attention(torch.cat([torch.zeros_like(q).expand(-1, -1, 4, -1), q], 2), k, v, pk, pv, 0.35,
                          sinks=sinks)[:, :, -1:]  # the last query of a causal pass sees every own token
    assert (fast - ref).abs().max() < 1e-13
    for a, r in zip(torch.autograd.grad(fast.sum(), [q, sinks]), torch.autograd.grad(ref.sum(), [q, sinks])):
        assert (a - r).abs().max() < 1e-12


def test_gradcheck_sinks(kernel):
    q, k, v, pk, pv = attention_inputs(1, 2, 1, 3, [2, 3], d=4)
    fn = lambda q, k, v, a, b, c, d, s: prefix_attention(q, k, v, [a, b], [c, d], 0.5, sinks=s)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v, *pk, *pv, _sinks(2)))
