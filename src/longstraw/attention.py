"""Attention of new tokens against a shared prompt state, without copying the prompt's K/V.

A replayed segment (a response, or one prompt chunk during capture) attends to two key sets:

* the **prefix**: K/V of every earlier prompt token, stored once as a list of chunks of batch 1 and
  shared by every sequence of a micro-batch (no expand, no concatenation, no mask: all of it is visible);
* its **own** tokens: causal attention within the segment.

The two partial softmaxes are merged exactly with their log-sum-exp. Both parts run through one custom
autograd function (flash-attention style: blocks of keys, online softmax, recomputation in backward), so
neither a `[T, P]` nor a `[T, T]` score matrix nor a copy of the prefix K/V is ever held; its
log-sum-exp output is differentiable, which the merge needs (torch's SDPA does not offer that). `naive_attention` beside it is the plain reference the parity tests compare with.

Shapes: B sequences, H query heads, Hkv key/value heads (GQA: H = Hkv * g), T new tokens, P prefix tokens,
D head dim. Queries of all B sequences and all g heads of a KV group are folded into one row set
`M = B * g * T` so the prefix K/V of shape (Hkv, P, D) is read once for all of them.
"""

from __future__ import annotations

import torch

# Keys per block inside the kernel: bounds the transient score block to (N, M, KEY_BLOCK).
KEY_BLOCK = 512


def _key_blocks(chunks: list[torch.Tensor]) -> list[tuple[int, int, int, int]]:
    """(chunk index, start in chunk, global key position, length) of every key block; blocks are views."""
    blocks, offset = [], 0
    for i, chunk in enumerate(chunks):
        n = chunk.shape[-2]
        for s in range(0, n, KEY_BLOCK):
            blocks.append((i, s, offset + s, min(KEY_BLOCK, n - s)))
        offset += n
    return blocks


def _visible(causal_group: int, rows: int, row0: int, key0: int, length: int, device) -> torch.Tensor | None:
    """Causal mask of one block: row r (position r // causal_group) sees key j iff j <= r // causal_group."""
    if not causal_group:
        return None
    pos = torch.arange(row0, row0 + rows, device=device) // causal_group
    keys = torch.arange(key0, key0 + length, device=device)
    return keys[None, :] <= pos[:, None]  # (M', c)


class BlockAttention(torch.autograd.Function):
    """softmax(q K^T * scale) V over a list of key/value chunks, returning the output and its log-sum-exp.

    Inputs: q (N, M, D); scale; causal_group; n; then n key chunks and n value chunks, each (1, N, c_j, D).
    causal_group = 0: every key is visible (the prompt prefix). causal_group = g > 0: rows are ordered
    (time, group) so row r sits at position r // g and sees keys 0 … r // g (a segment's own tokens); key
    blocks then only touch the rows at or after their first key, which skips the masked upper triangle.
    Outputs: out (N, M, D), lse (N, M). Key blocks are processed with an online softmax (flash-attention
    style); backward recomputes each block's probabilities from the saved lse.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, scale: float, causal_group: int, n: int, *kv: torch.Tensor):  # type: ignore[override]
        ks, vs = kv[:n], kv[n:]
        nh, m, d = q.shape
        run_max = torch.full((nh, m), float("-inf"), dtype=q.dtype, device=q.device)
        run_sum = torch.zeros((nh, m), dtype=q.dtype, device=q.device)
        acc = torch.zeros((nh, m, d), dtype=q.dtype, device=q.device)
        for i, s, key0, length in _key_blocks(list(ks)):
            r0 = key0 * causal_group  # rows before r0 see none of these keys
            k = ks[i][0].narrow(-2, s, length)  # (N, c, D), a view
            v = vs[i][0].narrow(-2, s, length)
            scores = torch.matmul(q[:, r0:], k.transpose(-1, -2)) * scale  # (N, M', c)
            mask = _visible(causal_group, m - r0, r0, key0, length, q.device)
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            new_max = torch.maximum(run_max[:, r0:], scores.amax(-1))
            correction = torch.exp(run_max[:, r0:] - new_max)
            p = torch.exp(scores - new_max.unsqueeze(-1))
            run_sum[:, r0:] = run_sum[:, r0:] * correction + p.sum(-1)
            acc[:, r0:] = acc[:, r0:] * correction.unsqueeze(-1) + torch.matmul(p, v)
            run_max[:, r0:] = new_max
        out = acc / run_sum.unsqueeze(-1)
        lse = run_max + torch.log(run_sum)
        ctx.scale, ctx.causal_group, ctx.n = scale, causal_group, n
        ctx.save_for_backward(q, out, lse, *kv)
        return out, lse

    @staticmethod
    def backward(ctx, d_out: torch.Tensor | None, d_lse: torch.Tensor | None):  # type: ignore[override]
        q, out, lse, *kv = ctx.saved_tensors
        n, scale, causal_group = ctx.n, ctx.scale, ctx.causal_group
        ks, vs = kv[:n], kv[n:]
        need_q, need_kv = ctx.needs_input_grad[0], any(ctx.needs_input_grad[4:])
        m = q.shape[1]
        if d_out is None:
            d_out = torch.zeros_like(out)
        # dS = P * (dP - rowsum(dO * O) + dLSE): the softmax backward plus d(lse)/d(s_j) = p_j.
        row = (d_out * out).sum(-1)  # (N, M)
        if d_lse is not None:
            row = row - d_lse
        dq = torch.zeros_like(q) if need_q else None
        dks = [torch.zeros_like(k) if need_kv else None for k in ks]
        dvs = [torch.zeros_like(v) if need_kv else None for v in vs]
        for i, s, key0, length in _key_blocks(list(ks)):
            r0 = key0 * causal_group
            k = ks[i][0].narrow(-2, s, length)  # (N, c, D)
            v = vs[i][0].narrow(-2, s, length)
            qb, dob = q[:, r0:], d_out[:, r0:]
            scores = torch.matmul(qb, k.transpose(-1, -2)) * scale  # (N, M', c)
            mask = _visible(causal_group, m - r0, r0, key0, length, q.device)
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            p = torch.exp(scores - lse[:, r0:].unsqueeze(-1))
            ds = p * (torch.matmul(dob, v.transpose(-1, -2)) - row[:, r0:].unsqueeze(-1))
            if need_q:
                dq[:, r0:].add_(torch.matmul(ds, k), alpha=scale)
            if need_kv:
                dks[i][0].narrow(-2, s, length).add_(torch.matmul(ds.transpose(-1, -2), qb), alpha=scale)
                dvs[i][0].narrow(-2, s, length).add_(torch.matmul(p.transpose(-1, -2), dob))
        return (dq, None, None, None, *dks, *dvs)


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
    Returns (B, H, T, D). Right padding needs no mask beyond causality: a real token never sees a later
    (padding) position.
    """
    b, h, t, d = query.shape
    hkv = key.shape[1]
    g = h // hkv
    q5 = query.view(b, hkv, g, t, d)  # heads of one KV group are adjacent in transformers' layout
    # Own tokens: rows ordered (time, group) per (sequence, kv head): (B, Hkv, g, T, D) -> (B*Hkv, T*g, D).
    q_own = q5.transpose(2, 3).reshape(b * hkv, t * g, d)
    k_own = key.reshape(1, b * hkv, t, d)
    v_own = value.reshape(1, b * hkv, t, d)
    out, lse = BlockAttention.apply(q_own, scale, g, 1, k_own, v_own)
    out = out.view(b, hkv, t, g, d).transpose(2, 3)  # (B, Hkv, g, T, D)
    lse = lse.view(b, hkv, t, g).transpose(2, 3)  # (B, Hkv, g, T)
    if not prefix_keys:
        return out.reshape(b, h, t, d)
    # Prefix: fold batch, group and time into one row set, (B, Hkv, g, T, D) -> (Hkv, B*g*T, D), so the
    # shared prefix K/V (Hkv, P, D) is read once for all sequences and heads.
    q_rows = q5.permute(1, 0, 2, 3, 4).reshape(hkv, b * g * t, d)
    n = len(prefix_keys)
    p_out, p_lse = BlockAttention.apply(q_rows, scale, 0, n, *prefix_keys, *prefix_values)
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
