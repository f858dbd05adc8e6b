"""Chunked attention (Llama-4's `attention_chunk_size`: a query sees the keys of its own chunk of positions, causally)
on the masked path `masked_prefix_attention` against its plain reference `naive_masked_prefix_attention`, in float64:
outputs and the gradients w.r.t. every input, with prompt chunks that straddle attention-chunk boundaries, a segment
that starts inside an attention chunk, GQA, and decoding (one query, earlier generated keys)."""

import pytest
import torch

from longstraw.engine.kernels.attention import masked_prefix_attention
from longstraw.engine.kernels.naive import naive_masked_prefix_attention

TOL = 1e-10  # relative, float64
SCALE = 0.35


def _inputs(prompt: list[tuple[int, int]], own_start: int, s: int, t: int, b: int = 2, h: int = 4, hkv: int = 2,
            d: int = 8, seed: int = 0):
    """Float64 leaves: q (b, h, t, d) for the last t of s own tokens at own_start…; own k/v (b, hkv, s, d); prompt
    chunks (start, k, v) of (1, hkv, c, d)."""
    gen = torch.Generator().manual_seed(seed)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_(True)

    q, k, v = leaf(b, h, t, d), leaf(b, hkv, s, d), leaf(b, hkv, s, d)
    prefix = [(start, leaf(1, hkv, c, d), leaf(1, hkv, c, d)) for start, c in prompt]
    own_pos = torch.arange(own_start, own_start + s)
    return q, k, v, prefix, own_pos[s - t:], own_pos


def _run(fn, q, k, v, prefix, q_pos, own_pos, chunk, window=None):
    out = fn(q, k, v, prefix, SCALE, q_pos, own_pos, window=window, chunk=chunk)
    out = out[0] if isinstance(out, tuple) else out
    leaves = [q, k, v, *[x for _, pk, pv in prefix for x in (pk, pv)]]
    weight = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out)
    return out, torch.autograd.grad((out * weight).sum(), leaves, allow_unused=True)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


@pytest.mark.parametrize("case", [
    # (prompt chunks, own start, own tokens, queries, attention chunk)
    ([(0, 5), (5, 7), (12, 9)], 21, 6, 6, 8),  # the segment starts inside attention chunk 2 and ends in chunk 3
    ([(0, 13), (13, 13)], 26, 9, 9, 16),  # capture-sized chunks across one boundary (16)
    ([(0, 16)], 16, 5, 5, 16),  # the segment starts a new attention chunk: it sees no prompt key
    ([(0, 10), (10, 10)], 20, 4, 1, 8),  # decoding: one query at 23 over 3 earlier generated keys
])
def test_chunked_masked_path_equals_the_reference(case):
    prompt, own_start, s, t, chunk = case
    inputs = _inputs(prompt, own_start, s, t)
    out, grads = _run(masked_prefix_attention, *inputs, chunk=chunk)
    ref_out, ref_grads = _run(naive_masked_prefix_attention, *inputs, chunk=chunk)
    assert _rel(out, ref_out) <= TOL
    for g, r in zip(grads, ref_grads):
        if r is None or float(r.norm()) == 0:  # a prompt chunk no query can see gets no gradient on either path
            assert g is None or float(g.norm()) == 0
        else:
            assert _rel(g, r) <= TOL
    unchunked, _ = _run(naive_masked_prefix_attention, *inputs, chunk=None)
    assert _rel(unchunked, ref_out) > 1e-2  # the chunk rule is exercised


def test_reference_mask_is_the_chunk_rule():
    """The reference's attention weights are zero exactly where key // chunk != query // chunk or key > query."""
    q, k, v, prefix, q_pos, own_pos = _inputs([(0, 6), (6, 6)], 12, 7, 7, b=1, h=1, hkv=1)
    values = torch.eye(19, dtype=torch.float64)  # value of key n is the one-hot e_n: the output row is its weights
    pv = [(start, pk, values[start : start + pk.shape[2]][None, None]) for start, pk, _ in prefix]
    out, _ = naive_masked_prefix_attention(q, k, values[12:][None, None], pv, SCALE, q_pos, own_pos, chunk=5)
    weights = out[0, 0]  # (T, 19)
    keys = torch.arange(19)
    expected = (keys[None, :] // 5 == q_pos[:, None] // 5) & (keys[None, :] <= q_pos[:, None])
    assert torch.equal(weights > 0, expected)
