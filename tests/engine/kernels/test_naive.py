"""The masked attention path (`masked_prefix_attention`: sliding windows, DSA selection, MLA latents, logit
soft-capping, GQA) against its plain reference `naive_masked_prefix_attention`, in float64: outputs,
log-sum-exps and the gradients of a loss using both, w.r.t. every input (query, own K/V, every prefix chunk,
the MLA expansion's weights).

`masked_prefix_attention` returns only its output; its log-sum-exp is the log-sum-exp of its parts' (one per
visible prefix chunk, one for the own tokens), which the merge forms internally. A spy on `_masked_part`
records the parts the fast path actually computed, so the test can form that total (differentiably) and put it
in the loss: the gradient parity then covers the LSE gradients the merge relies on.
"""

from dataclasses import dataclass, field

import pytest
import torch

import longstraw.engine.kernels.attention as attention
import longstraw.engine.kernels.naive as attention_naive
from longstraw.engine.kernels.attention import masked_prefix_attention
from longstraw.engine.kernels.naive import naive_masked_prefix_attention

TOL = 1e-10  # relative, float64
SCALE = 0.35


@dataclass
class Case:
    kwargs: dict  # the arguments both functions take
    leaves: list[torch.Tensor]  # every tensor that requires grad
    w_out: torch.Tensor = field(repr=False)  # random loss weights for the output and the log-sum-exp
    w_lse: torch.Tensor = field(repr=False)


def _case(b=2, h=4, hkv=4, chunks=((0, 5), (5, 7)), t=6, s=None, own_start=None, window=None, dsa=False,
          mla=False, softcap=None, empty_parts=False, sinks=False, d=8, seed=0) -> Case:
    """Random float64 inputs. chunks: (start, length) of the kept prompt chunks. Own tokens at own_start …
    own_start + s − 1 (default: right after the last chunk, s = t); the queries are the last t of them (t = s:
    capture/replay; t = 1 < s: decoding). empty_parts (with dsa): sequence 0 selects no own key (only prompt
    key 0), sequence 1 no prompt key, so some parts are entirely masked for some rows. sinks: a random (H,)
    attention-sink leaf (gpt-oss)."""
    gen = torch.Generator().manual_seed(seed)
    def leaf(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_(True)
    s = t if s is None else s
    if own_start is None:
        own_start = chunks[-1][0] + chunks[-1][1] if chunks else 0
    own_pos = torch.arange(own_start, own_start + s)
    q_pos = own_pos[s - t:]
    extra: list[torch.Tensor] = []
    expand = None
    if mla:  # latents (1, 1, c, d_c) + shared rope keys (1, 1, c, d_R) -> K (1, H, c, d_n + d_R), V (1, H, c, d_v)
        d_c, d_n, d_r, d_v = 7, 6, 4, 5
        wk, wv = leaf(d_c, h, d_n), leaf(d_c, h, d_v)
        extra = [wk, wv]
        def expand(latent, rope):
            k_nope = torch.einsum("xocl,lhd->xhcd", latent, wk)
            return (torch.cat([k_nope, rope.expand(-1, h, -1, -1)], dim=-1),
                    torch.einsum("xocl,lhd->xhcd", latent, wv))
        d_k = d_n + d_r
        prefix = [(start, leaf(1, 1, c, d_c), leaf(1, 1, c, d_r)) for start, c in chunks]
        key, value = leaf(b, h, s, d_k), leaf(b, h, s, d_v)  # own K/V arrive expanded (one per head)
    else:
        d_k = d_v = d
        prefix = [(start, leaf(1, hkv, c, d), leaf(1, hkv, c, d)) for start, c in chunks]
        key, value = leaf(b, hkv, s, d), leaf(b, hkv, s, d)
    query = leaf(b, h, t, d_k)
    select = None
    if dsa:  # a random half of [prompt ; own] per sequence and query, always including the query itself
        select = torch.rand(b, t, own_start + s, generator=gen) < 0.5
        select[:, torch.arange(t), q_pos] = True
        if empty_parts:
            select[0, :, own_start:], select[0, :, 0] = False, True
            select[1, :, :own_start] = False
    sink = leaf(h) if sinks else None
    kwargs = dict(query=query, key=key, value=value, prefix=prefix, scale=SCALE, q_pos=q_pos, own_pos=own_pos,
                  window=window, select=select, expand=expand, softcap=softcap, sinks=sink)
    leaves = [query, key, value, *(x for _, k, v in prefix for x in (k, v)), *extra, *([sink] if sinks else [])]
    return Case(kwargs, leaves, torch.randn(b, h, t, d_v, generator=gen, dtype=torch.float64),
                torch.randn(b, h, t, generator=gen, dtype=torch.float64))


@pytest.fixture
def parts(monkeypatch):
    """Records (out, lse) of every `_masked_part` the fast path runs (checkpointed ones included)."""
    recorded: list[tuple[torch.Tensor, torch.Tensor]] = []
    real = attention._masked_part
    def spy(*args, **kwargs):
        result = real(*args, **kwargs)
        recorded.append(result)
        return result
    monkeypatch.setattr(attention, "_masked_part", spy)
    return recorded


def _rel(a: torch.Tensor | None, r: torch.Tensor) -> float:
    a = torch.zeros_like(r) if a is None else a  # a chunk the fast path skips gets no gradient (None)
    return ((a - r).abs().max() / r.abs().max().clamp_min(1e-300)).item()


def _errors(case: Case, parts: list, **ref_overrides) -> dict[str, float]:
    """Relative max errors of output, log-sum-exp and each leaf's gradient (loss = <w, out> + <w', lse>)."""
    parts.clear()
    out = masked_prefix_attention(**case.kwargs)
    lse = torch.logsumexp(torch.stack([l for _, l in parts]), dim=0)  # the merge's total, as the fast path forms it
    sinks = case.kwargs["sinks"]
    if sinks is not None:  # the sink is one more part (out 0, lse = sink), which `with_sinks` adds after the merge
        lse = torch.logaddexp(lse, sinks.view(1, -1, 1))
    ref_out, ref_lse = naive_masked_prefix_attention(**{**case.kwargs, **ref_overrides})
    loss = lambda o, l: (o * case.w_out).sum() + (l * case.w_lse).sum()  # noqa: E731
    g_fast = torch.autograd.grad(loss(out, lse), case.leaves, allow_unused=True)
    g_ref = torch.autograd.grad(loss(ref_out, ref_lse), case.leaves)
    errors = {"out": _rel(out, ref_out), "lse": _rel(lse, ref_lse)}
    errors.update({f"grad{i}": _rel(a, r) for i, (a, r) in enumerate(zip(g_fast, g_ref))})
    return errors


CASES = {
    # plain causal over a two-chunk prefix (the masked path without any mask beyond causality)
    "causal": dict(),
    "causal_b1_one_chunk": dict(b=1, chunks=((0, 9),)),
    "gqa_g3": dict(h=6, hkv=2),
    "gqa_g4_mqa": dict(h=4, hkv=1),
    # no prefix at all: the first capture chunk
    "no_prefix": dict(chunks=()),
    "no_prefix_window": dict(chunks=(), window=3),
    # sliding windows over prefix 0..11, own/queries 12..17
    "window_1_self_only": dict(window=1),  # every prefix chunk skipped, one part
    "window_3_crosses_boundary": dict(window=3),  # chunk 0 skipped, chunk 1 partly, query 12 sees 10, 11 | 12
    "window_8": dict(window=8),  # chunk 0 skipped, chunk 1 fully for query 12
    "window_14_partial_first_chunk": dict(window=14),  # query 17 sees 4 … 17
    "window_dropped_chunks": dict(chunks=((4, 3), (7, 5)), window=6, h=6, hkv=3),  # positions 0 … 3 dropped
    # DSA selection over [prompt ; own], per sequence
    "dsa": dict(dsa=True),
    "dsa_gqa_window": dict(dsa=True, h=6, hkv=2, window=9),
    "dsa_empty_parts": dict(dsa=True, empty_parts=True),  # a part that a row sees nothing of weighs exactly 0
    # MLA latents expanded per chunk; MLA + DSA (GLM-5)
    "mla": dict(mla=True, chunks=((0, 4), (4, 6), (10, 3))),
    "mla_dsa": dict(mla=True, dsa=True),
    # tanh soft-capping (scores ~ N(0, 1), cap 1.5: well inside tanh's curved part)
    "softcap": dict(softcap=1.5),
    "softcap_gqa_window": dict(softcap=1.5, h=6, hkv=2, window=4),
    "softcap_mla_dsa": dict(softcap=2.0, mla=True, dsa=True),
    # decoding: one query (the last own position) over the prompt and the tokens generated so far
    "decode": dict(t=1, s=5),
    "decode_window_crosses": dict(t=1, s=5, window=7),  # query 16 sees 10, 11 | 12 … 16
    "decode_dsa_softcap": dict(t=1, s=5, dsa=True, softcap=1.5, h=6, hkv=2),
    "decode_mla_dsa_softcap_empty_parts": dict(t=1, s=5, mla=True, dsa=True, softcap=1.5, empty_parts=True),
    # attention sinks (gpt-oss: sliding and full layers, GQA), alone, with a window, decoding, with every other term
    "sinks": dict(sinks=True),
    "sinks_gqa_window": dict(sinks=True, h=6, hkv=2, window=3),
    "sinks_window_1_self_only": dict(sinks=True, window=1),
    "sinks_no_prefix": dict(sinks=True, chunks=()),
    "sinks_decode_window": dict(sinks=True, t=1, s=5, window=7, h=6, hkv=3),
    "sinks_softcap_mla_dsa_empty_parts": dict(sinks=True, softcap=1.5, mla=True, dsa=True, empty_parts=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_masked_path_matches_naive_reference(name, parts):
    errors = _errors(_case(**CASES[name]), parts)
    assert max(errors.values()) <= TOL, errors


@pytest.mark.parametrize("name", ["window_3_crosses_boundary", "mla_dsa", "softcap_gqa_window"])
def test_masked_path_without_grad_matches(name):
    """Under no_grad the fast path runs its parts without checkpointing: same output."""
    case = _case(**CASES[name])
    with torch.no_grad():
        out = masked_prefix_attention(**case.kwargs)
        ref, _ = naive_masked_prefix_attention(**case.kwargs)
    assert _rel(out, ref) <= TOL


# --- the comparison can fail ----------------------------------------------------------------------------------

def _shift_select(kw):
    return {"select": torch.roll(kw["select"], 1, dims=-1)}


@pytest.mark.parametrize("name,perturb", [
    ("window_3_crosses_boundary", lambda kw: {"window": 4}),  # window off by one, each way
    ("window_3_crosses_boundary", lambda kw: {"window": 2}),
    ("decode_window_crosses", lambda kw: {"window": 8}),
    ("softcap", lambda kw: {"softcap": None}),  # soft-cap dropped
    ("softcap", lambda kw: {"softcap": 1.6}),
    ("dsa", _shift_select),  # selection off by one position
    ("window_8", lambda kw: {"q_pos": kw["q_pos"] + 1}),  # positions off by one
    ("mla", lambda kw: {"scale": SCALE * 1.01}),
    ("sinks_gqa_window", lambda kw: {"sinks": kw["sinks"] - 30}),  # sinks as good as dropped (weight e^-30)
    ("sinks_gqa_window", lambda kw: {"sinks": kw["sinks"].roll(1)}),  # sinks on the wrong heads
])
def test_parity_check_detects_a_perturbed_reference(name, perturb, parts):
    case = _case(**CASES[name])
    errors = _errors(case, parts, **perturb(case.kwargs))
    assert max(errors.values()) > 1e3 * TOL, errors


def test_parity_check_detects_a_wrong_gqa_head_mapping(parts, monkeypatch):
    """Query head i reads KV head i // g; a reference that tiled the heads (i % Hkv) must be caught."""
    tiled = lambda x, heads: x[:, torch.arange(heads) % x.shape[1]]  # noqa: E731
    monkeypatch.setattr(attention_naive, "_to_heads", tiled)
    errors = _errors(_case(**CASES["gqa_g3"]), parts)
    assert errors["out"] > 1e3 * TOL, errors


def test_naive_reference_mask_by_hand():
    """Zero queries give uniform weights over the visible keys; one-hot values then read the mask back.
    Keys at 1, 2 (prefix) and 3, 4 (own), queries at 3, 4, window 2: query 3 sees {2, 3}, query 4 sees {3, 4};
    with the selection dropping key 3 for query 4, query 4 sees {4}."""
    eye = torch.eye(4, dtype=torch.float64)
    zeros = torch.zeros(1, 1, 2, 3, dtype=torch.float64)
    kw = dict(query=zeros, key=zeros, value=eye[None, None, 2:], prefix=[(1, zeros, eye[None, None, :2])], scale=1.0,
              q_pos=torch.tensor([3, 4]), own_pos=torch.tensor([3, 4]), window=2)
    out, lse = naive_masked_prefix_attention(**kw)
    assert torch.equal(out[0, 0], torch.tensor([[0, 0.5, 0.5, 0], [0, 0, 0.5, 0.5]], dtype=torch.float64))
    assert torch.allclose(lse[0, 0], torch.log(torch.tensor([2.0, 2.0], dtype=torch.float64)))
    select = torch.ones(1, 2, 5, dtype=torch.bool)
    select[0, 1, 3] = False
    out, lse = naive_masked_prefix_attention(**kw, select=select)
    assert torch.equal(out[0, 0], torch.tensor([[0, 0.5, 0.5, 0], [0, 0, 0, 1]], dtype=torch.float64))
    # soft-capping is applied to the scaled score: one visible key (window 1), lse = cap * tanh(score / cap)
    q, k = torch.ones(1, 1, 2, 3, dtype=torch.float64), torch.ones(1, 1, 2, 3, dtype=torch.float64)
    _, lse = naive_masked_prefix_attention(**{**kw, "query": q, "key": k, "window": 1, "scale": 2.0}, softcap=4.0)
    assert torch.allclose(lse[0, 0], torch.full((2,), 4.0 * torch.tanh(torch.tensor(6.0 / 4.0)).item(),
                                                dtype=torch.float64))
