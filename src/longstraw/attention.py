"""Attention of new tokens against a shared prompt state, without copying the prompt's K/V.

A replayed segment (a response, or one prompt chunk during capture) attends to two key sets:

* the **prefix**: K/V of every earlier prompt token, stored once as a list of chunks of batch 1 and
  shared by every sequence of a micro-batch (no expand, no concatenation, no mask: all of it is visible);
* its **own** tokens: causal attention within the segment.

The two partial softmaxes are merged exactly with their log-sum-exp. The prefix part is a custom autograd
function (flash-attention style: blocks of keys, online softmax, recomputation in backward) so neither a
`[T, P]` score matrix nor a copy of the prefix K/V is ever held; its log-sum-exp output is differentiable,
which the merge needs. `naive_attention` beside it is the plain reference the parity tests compare with.

Shapes: B sequences, H query heads, Hkv key/value heads (GQA: H = Hkv * g), T new tokens, P prefix tokens,
D head dim. Queries of all B sequences and all g heads of a KV group are folded into one row set
`M = B * g * T` so the prefix K/V of shape (Hkv, P, D) is read once for all of them.
"""

from __future__ import annotations

import torch

# Keys per block inside the prefix kernel: bounds the transient score block to (Hkv, M, KEY_BLOCK).
KEY_BLOCK = 1024


def _key_blocks(chunks: list[torch.Tensor]) -> list[tuple[int, int, int]]:
    """(chunk index, start, length) of every key block, each a view of one stored chunk."""
    blocks = []
    for i, chunk in enumerate(chunks):
        n = chunk.shape[-2]
        for s in range(0, n, KEY_BLOCK):
            blocks.append((i, s, min(KEY_BLOCK, n - s)))
    return blocks


class PrefixAttention(torch.autograd.Function):
    """softmax(q K^T * scale) V over the prefix, returning the output and its log-sum-exp.

    Inputs: q (Hkv, M, D); scale; n chunk count; then n key chunks and n value chunks, each (1, Hkv, c_j, D).
    Outputs: out (Hkv, M, D), lse (Hkv, M) in the compute dtype.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, scale: float, n: int, *kv: torch.Tensor):  # type: ignore[override]
        ks, vs = kv[:n], kv[n:]
        hkv, m, d = q.shape
        run_max = torch.full((hkv, m), float("-inf"), dtype=q.dtype, device=q.device)
        run_sum = torch.zeros((hkv, m), dtype=q.dtype, device=q.device)
        acc = torch.zeros((hkv, m, d), dtype=q.dtype, device=q.device)
        for i, s, length in _key_blocks(list(ks)):
            k = ks[i][0].narrow(-2, s, length)  # (Hkv, c, D), a view
            v = vs[i][0].narrow(-2, s, length)
            scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # (Hkv, M, c)
            new_max = torch.maximum(run_max, scores.amax(-1))
            correction = torch.exp(run_max - new_max)
            p = torch.exp(scores - new_max.unsqueeze(-1))
            run_sum = run_sum * correction + p.sum(-1)
            acc = acc * correction.unsqueeze(-1) + torch.matmul(p, v)
            run_max = new_max
        out = acc / run_sum.unsqueeze(-1)
        lse = run_max + torch.log(run_sum)
        ctx.scale, ctx.n = scale, n
        ctx.save_for_backward(q, out, lse, *kv)
        return out, lse

    @staticmethod
    def backward(ctx, d_out: torch.Tensor, d_lse: torch.Tensor | None):  # type: ignore[override]
        q, out, lse, *kv = ctx.saved_tensors
        n, scale = ctx.n, ctx.scale
        ks, vs = kv[:n], kv[n:]
        need_q = ctx.needs_input_grad[0]
        need_kv = any(ctx.needs_input_grad[3:])
        if d_out is None:
            d_out = torch.zeros_like(out)
        # dS = P * (dP - rowsum(dO * O) + dLSE): the softmax backward plus d(lse)/d(s_j) = p_j.
        row = (d_out * out).sum(-1)  # (Hkv, M)
        if d_lse is not None:
            row = row - d_lse
        dq = torch.zeros_like(q) if need_q else None
        dks = [torch.zeros_like(k) if need_kv else None for k in ks]
        dvs = [torch.zeros_like(v) if need_kv else None for v in vs]
        for i, s, length in _key_blocks(list(ks)):
            k = ks[i][0].narrow(-2, s, length)  # (Hkv, c, D)
            v = vs[i][0].narrow(-2, s, length)
            p = torch.exp(torch.matmul(q, k.transpose(-1, -2)) * scale - lse.unsqueeze(-1))  # (Hkv, M, c)
            dp = torch.matmul(d_out, v.transpose(-1, -2))
            ds = p * (dp - row.unsqueeze(-1))
            if need_q:
                dq.add_(torch.matmul(ds, k), alpha=scale)
            if need_kv:
                dks[i][0].narrow(-2, s, length).add_(torch.matmul(ds.transpose(-1, -2), q), alpha=scale)
                dvs[i][0].narrow(-2, s, length).add_(torch.matmul(p.transpose(-1, -2), d_out))
        return (dq, None, None, *dks, *dvs)


def _own_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Causal attention of the new tokens among themselves.

    q (B, Hkv, g, T, D), k/v (B, Hkv, T, D) -> out (B, Hkv, g, T, D), lse (B, Hkv, g, T).
    Right padding needs no mask beyond causality: a real token never sees a later (padding) position.
    """
    t = q.shape[-2]
    scores = torch.einsum("bkgtd,bksd->bkgts", q, k) * scale  # (B, Hkv, g, T, T)
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    out = torch.einsum("bkgts,bksd->bkgtd", probs, v)
    return out, lse


def prefix_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    prefix_keys: list[torch.Tensor],
    prefix_values: list[torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """Attention of new tokens over [prefix ; own causal], exactly merged.

    query (B, H, T, D); key/value (B, Hkv, T, D); prefix chunks (1, Hkv, c_j, D) shared by all B.
    Returns (B, H, T, D).
    """
    b, h, t, d = query.shape
    hkv = key.shape[1]
    g = h // hkv
    q5 = query.view(b, hkv, g, t, d)  # heads of one KV group are adjacent in transformers' layout
    out, lse = _own_attention(q5, key, value, scale)
    if not prefix_keys:
        return out.reshape(b, h, t, d)
    # Fold batch, group and time into one row set: (B, Hkv, g, T, D) -> (Hkv, B*g*T, D).
    q_rows = q5.permute(1, 0, 2, 3, 4).reshape(hkv, b * g * t, d)
    n = len(prefix_keys)
    p_out, p_lse = PrefixAttention.apply(q_rows, scale, n, *prefix_keys, *prefix_values)
    p_out = p_out.view(hkv, b, g, t, d).permute(1, 0, 2, 3, 4)  # (B, Hkv, g, T, D)
    p_lse = p_lse.view(hkv, b, g, t).permute(1, 0, 2, 3)  # (B, Hkv, g, T)
    total = torch.logaddexp(lse, p_lse)
    merged = torch.exp(lse - total).unsqueeze(-1) * out + torch.exp(p_lse - total).unsqueeze(-1) * p_out
    return merged.reshape(b, h, t, d)


def naive_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    prefix_keys: list[torch.Tensor],
    prefix_values: list[torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """Plain reference for `prefix_attention`: concatenate, repeat heads, mask, softmax. Same shapes."""
    b, h, t, d = query.shape
    hkv = key.shape[1]
    if prefix_keys:
        pk = torch.cat(prefix_keys, dim=-2).expand(b, -1, -1, -1)
        pv = torch.cat(prefix_values, dim=-2).expand(b, -1, -1, -1)
        key, value = torch.cat([pk, key], dim=-2), torch.cat([pv, value], dim=-2)
    p = key.shape[-2] - t
    key = key.repeat_interleave(h // hkv, dim=1)
    value = value.repeat_interleave(h // hkv, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale  # (B, H, T, P+T)
    visible = torch.ones(t, p + t, dtype=torch.bool, device=query.device).tril(diagonal=p)
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), value)
