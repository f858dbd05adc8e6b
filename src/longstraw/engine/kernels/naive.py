"""Plain reference for the masked attention path (`attention.masked_prefix_attention`).

One full score matrix over every key, one explicit mask from absolute positions, one softmax; nothing chunked,
checkpointed, merged or taken from `attention.py` (tests/engine/kernels/test_naive.py holds the fast path to it)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def _to_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(Bx, Hkv, n, D) -> (Bx, heads, n, D): query head i reads key/value head i // (heads / Hkv) (GQA)."""
    return x[:, torch.arange(heads, device=x.device) // (heads // x.shape[1])]


# `attention.masked_prefix_attention`'s signature (duplicates lists it): parity tests call both with the same arguments.
def naive_masked_prefix_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, prefix: list[tuple[int, torch.Tensor, torch.Tensor]],
    scale: float, q_pos: torch.Tensor, own_pos: torch.Tensor, window: int | None = None,
    select: torch.Tensor | None = None,
    expand: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
    softcap: float | None = None, sinks: torch.Tensor | None = None, chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of T queries over [prefix keys ; own keys], same arguments as `masked_prefix_attention`.

    query (B, H, T, Dk) at absolute positions q_pos (T,). Own key (B, Hkv, S, Dk), value (B, Hkv, S, Dv) at
    absolute positions own_pos (S,), consecutive. prefix: (start, key, value) per prompt chunk, key
    (1, Hkv, c, Dk), value (1, Hkv, c, Dv) at positions start … start + c − 1, shared by all B sequences; with
    `expand` (MLA) the chunk holds latents (1, 1, c, d_c) and rope keys (1, 1, c, d_R) instead, and
    expand(latents, rope keys) gives key (1, H, c, Dk) and value (1, H, c, Dv).

    Query at position q sees key at position k iff
      k <= q                            (causal),
      and q − k < window                (sliding window, if any: the window holds q itself and window − 1 before),
      and select[b, t, k]               (DSA, if any: select (B, T, own_pos[0] + S) bool, by absolute position),
      and k // chunk == q // chunk      (chunked attention, if any: Llama-4's attention_chunk_size).
    Scores are (q · k) * scale, soft-capped to softcap · tanh(score / softcap) before masking if softcap is set.

    sinks (H,), if set: one more score per head, exp(sinks[h]) in the softmax's denominator with no value (not
    soft-capped, never masked), as transformers' eager gpt-oss attention concatenates it.

    Returns out (B, H, T, Dv) and lse (B, H, T) = log (Σ_visible exp(score) [+ exp(sink)]). Every query must see
    at least one key (otherwise its row is NaN)."""
    b, h, t, _ = query.shape
    keys, values, positions = [], [], []
    if prefix:
        pk = torch.cat([k for _, k, _ in prefix], dim=2)  # (1, Hkv, P, Dk), or MLA latents (1, 1, P, d_c)
        pv = torch.cat([v for _, _, v in prefix], dim=2)
        if expand is not None:
            pk, pv = expand(pk, pv)  # (1, H, P, Dk), (1, H, P, Dv)
        keys.append(_to_heads(pk, h).expand(b, -1, -1, -1))
        values.append(_to_heads(pv, h).expand(b, -1, -1, -1))
        positions += [torch.arange(start, start + k.shape[2]) for start, k, _ in prefix]
    keys.append(_to_heads(key, h))
    values.append(_to_heads(value, h))
    positions.append(own_pos.cpu())
    k_all, v_all = torch.cat(keys, dim=2), torch.cat(values, dim=2)  # (B, H, N, Dk), (B, H, N, Dv); N = P + S
    k_pos = torch.cat(positions).to(query.device)  # (N,)

    scores = torch.einsum("bhtd,bhnd->bhtn", query, k_all) * scale  # (B, H, T, N)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    distance = q_pos[:, None] - k_pos[None, :]  # (T, N): how far back the key is
    visible = (distance >= 0).expand(b, t, -1)  # (B, T, N)
    if window is not None:
        visible = visible & (distance < window)
    if chunk is not None:
        visible = visible & (q_pos[:, None] // chunk == k_pos[None, :] // chunk)
    if select is not None:
        visible = visible & select[:, :, k_pos]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    if sinks is not None:  # (B, H, T, N + 1): the sink's column last, dropped after the softmax
        scores = torch.cat([scores, sinks.to(scores.dtype).view(1, h, 1, 1).expand(b, h, t, 1)], dim=-1)
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, T)
    weights = torch.softmax(scores, dim=-1)
    if sinks is not None:
        weights = weights[..., :-1]
    out = torch.einsum("bhtn,bhnd->bhtd", weights, v_all)
    return out, lse
