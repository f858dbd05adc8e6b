"""Attention of new tokens against a shared prompt state, without copying the prompt's K/V.

A replayed segment (a response, or one prompt chunk during capture) attends to two key sets:

* the **prefix**: K/V of every earlier prompt token, stored once as a list of chunks of batch 1 and
  shared by every sequence of a micro-batch (no expand, no concatenation, no mask: all of it is visible);
* its **own** tokens: causal attention within the segment.

The two partial softmaxes are merged exactly by their log-sum-exp. Both run through one custom autograd function,
`ChunkAttention` (online softmax over chunks, recomputation in backward), so no `[T, P]` or `[T, T]` score matrix nor
a copy of the prefix K/V is held; its log-sum-exp output is differentiable (torch's SDPA offers none). `naive_attention`
is the plain reference the parity tests compare with. Shapes: B sequences, H query heads, Hkv key/value heads (GQA:
H = Hkv * g), T new tokens, P prefix tokens, D head dim. For the prefix, queries of all B sequences and all g heads of
a KV group are folded into one row set `M = B * g * T`, so the prefix K/V (Hkv, P, D) is read once for all of them."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from longstraw.engine.kernels.fused import choose_kernel, fold_lse_gradient, fused_backward, fused_forward, refused
from longstraw.engine.kernels.naive import naive_masked_prefix_attention
from longstraw.engine.precision import accumulation_dtype

if TYPE_CHECKING:
    from longstraw.engine.state.sharding import ContextShards


# Set False to force the portable kernel everywhere (the parity tests run both).
USE_FUSED = True
# Keys per block in the portable kernel: bounds its transient score block to (N, M, KEY_BLOCK).
KEY_BLOCK = 512
# Keys per backward call: a run's backward goes through pieces of whole chunks of at most this many keys (at least
# one chunk each). Its transients (the padded K/V copies of `fused_backward` and the K/V gradients at the padded
# width, ~4x a piece's K) stay those of 16K keys instead of a layer's whole prefix (1 GB+ per layer at 10^6 tokens),
# while each call has enough keys to keep a GPU busy.
BACKWARD_KEYS = 16384
QUERY_TILE = 2**18  # scores per tile of `_query_backward`: two fp32 tiles of 1 MiB
# A run of adjacent chunks: key (1, N, c, D), value (1, N, c, D) and its chunks' key counts.
_Run = tuple[torch.Tensor, torch.Tensor, list[int]]


def _portable_forward(q, k, v, scale: float, causal: bool):
    """One key chunk, key blocks with an online softmax. q (N, M, D), k/v (N, c, D) -> out (N, M, D), lse (N, M). causal
    (own tokens, M == c): row r sees keys 0 … r; a key block starting at key0 only touches rows >= key0, so every
    processed row sees at least one key of every block it is in (no all-masked rows, no NaN)."""
    n, m, d = q.shape
    run_max = torch.full((n, m), float("-inf"), dtype=q.dtype, device=q.device)
    run_sum = torch.zeros((n, m), dtype=q.dtype, device=q.device)
    acc = torch.zeros((n, m, d), dtype=q.dtype, device=q.device)
    for key0 in range(0, k.shape[1], KEY_BLOCK):
        length = min(KEY_BLOCK, k.shape[1] - key0)
        r0 = key0 if causal else 0
        scores = torch.matmul(q[:, r0:], k[:, key0 : key0 + length].transpose(-1, -2)) * scale  # (N, M', c)
        if causal:
            scores = scores.masked_fill(~_causal_mask(m - r0, r0, key0, length, q.device), float("-inf"))
        new_max = torch.maximum(run_max[:, r0:], scores.amax(-1))
        correction = torch.exp(run_max[:, r0:] - new_max)
        p = torch.exp(scores - new_max.unsqueeze(-1))
        run_sum[:, r0:] = run_sum[:, r0:] * correction + p.sum(-1)
        acc[:, r0:] = acc[:, r0:] * correction.unsqueeze(-1) + torch.matmul(p, v[:, key0 : key0 + length])
        run_max[:, r0:] = new_max
    return acc / run_sum.unsqueeze(-1), run_max + torch.log(run_sum)


def _causal_mask(rows: int, row0: int, key0: int, length: int, device) -> torch.Tensor:
    """(rows, length) bool: row row0+i sees key key0+j iff key0+j <= row0+i."""
    keys = torch.arange(key0, key0 + length, device=device)
    return keys[None, :] <= torch.arange(row0, row0 + rows, device=device)[:, None]


def _portable_backward(d_out, row, q, k, v, lse, scale: float, causal: bool, need_kv: bool):
    """Gradients of one key chunk given the *global* out/lse: p = exp(s − lse) is this chunk's slice of the full
    softmax, and dS = p * (dP − row) with row = rowsum(dO * O) − dLSE. dk/dv are None unless need_kv."""
    m = q.shape[1]
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k) if need_kv else None
    dv = torch.zeros_like(v) if need_kv else None
    for key0 in range(0, k.shape[1], KEY_BLOCK):
        length = min(KEY_BLOCK, k.shape[1] - key0)
        r0 = key0 if causal else 0
        kb, vb = k[:, key0 : key0 + length], v[:, key0 : key0 + length]
        qb, dob = q[:, r0:], d_out[:, r0:]
        scores = torch.matmul(qb, kb.transpose(-1, -2)) * scale  # (N, M', c)
        if causal:
            scores = scores.masked_fill(~_causal_mask(m - r0, r0, key0, length, q.device), float("-inf"))
        p = torch.exp(scores - lse[:, r0:].unsqueeze(-1))
        ds = p * (torch.matmul(dob, vb.transpose(-1, -2)) - row[:, r0:].unsqueeze(-1))
        dq[:, r0:].add_(torch.matmul(ds, kb), alpha=scale)
        if dk is not None and dv is not None:  # need_kv
            dk[:, key0 : key0 + length].add_(torch.matmul(ds.transpose(-1, -2), qb), alpha=scale)
            dv[:, key0 : key0 + length].add_(torch.matmul(p.transpose(-1, -2), dob))
    return dq, dk, dv


class ChunkAttention(torch.autograd.Function):
    """softmax(q K^T * scale) V over a list of key/value chunks, returning the output and its log-sum-exp.

    Inputs: q (N, M, D); scale; causal; n; then n key chunks and n value chunks, each (1, N, c_j, D). causal = False:
    every key is visible (the prompt prefix); True (one chunk, M == c): the segment's own tokens. Outputs: out (N, M,
    D), lse (N, M), both differentiable, in the accumulation dtype (`precision.py`).

    Adjacent views of one tensor (`adjacent_runs`) are read as one run; runs are combined with an online softmax, so
    only the final out/lse are saved; backward runs each run's backward against the global out/lse, in pieces of at
    most `BACKWARD_KEYS` keys, and hands every input chunk its slice of the gradient. Per run a fused op runs where one
    takes q's device, dtype and head dim (`fused.choose_kernel`), else the portable blocked kernel above (same math);
    an op that refuses its inputs at run time is logged once, and that run and every later one run the portable one.
    On CPU, key chunks without grad (a detached prompt state) take `_query_backward`, which forms dq alone, where
    `query_backward_fits`."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, scale: float, causal: bool, n: int, *kv: torch.Tensor):
        kernel = choose_kernel(q, USE_FUSED)
        acc = accumulation_dtype(q.dtype)  # merges and log-sum-exps in >= fp32: bf16 would lose ~1% per merge
        out: torch.Tensor | None = None
        lse: torch.Tensor | None = None
        kernels, aux = [], []
        for k, v, _ in adjacent_runs(kv[:n], kv[n:]):
            o = l = a = None
            if kernel != "portable":
                try:
                    o, l, a = fused_forward(kernel, q, k, v, scale, causal)
                    o, l = o.to(acc), l.to(acc)
                except torch.OutOfMemoryError:
                    raise
                except RuntimeError as err:  # the op refused these inputs (e.g. an old GPU, a head dim)
                    refused(kernel, q, err)
                    kernel = "portable"
            if o is None or l is None:
                o, l = _portable_forward(q.to(acc), k[0].to(acc), v[0].to(acc), scale, causal)
            kernels.append(kernel)
            aux.append(a)
            if out is None or lse is None:  # the first chunk (both are set together)
                out, lse = o, l
            else:
                new = torch.logaddexp(lse, l)
                out = out * torch.exp(lse - new).unsqueeze(-1) + o * torch.exp(l - new).unsqueeze(-1)
                lse = new
        if out is None or lse is None:
            raise ValueError("ChunkAttention needs at least one key/value chunk")
        ctx.scale, ctx.causal, ctx.n, ctx.kernels, ctx.aux = scale, causal, n, kernels, aux
        ctx.save_for_backward(q, out, lse, *kv)
        return out, lse  # both in the accumulation dtype: the caller merges them, then casts

    @staticmethod
    def backward(ctx, d_out: torch.Tensor | None, d_lse: torch.Tensor | None):
        q, out, lse, *kv = ctx.saved_tensors  # out and lse in the accumulation dtype
        n = ctx.n
        need_kv = any(ctx.needs_input_grad[4:])
        d_out = torch.zeros_like(out) if d_out is None else d_out.to(out.dtype).contiguous()
        d_lse = torch.zeros_like(lse) if d_lse is None else d_lse.to(lse.dtype)
        row = (d_out * out).sum(-1) - d_lse  # (N, M), used by the portable kernel
        fold = fold_lse_gradient(d_out.to(q.dtype), out.to(q.dtype), d_lse) if "cpu_flash" in ctx.kernels else None
        dq = torch.zeros_like(out)
        dks: list[torch.Tensor | None] = []
        dvs: list[torch.Tensor | None] = []
        pieces = [(j, k, v, sizes) for j, run in enumerate(adjacent_runs(kv[:n], kv[n:]))
                  for k, v, sizes in _pieces(*run, BACKWARD_KEYS)]
        for j, k, v, sizes in pieces:
            dq_j, dk_j, dv_j = _piece_backward(ctx, j, d_out, d_lse, row, q, out, lse, k, v, need_kv, fold)
            dq += dq_j
            # One gradient per input chunk: a piece's gradient split back along the keys (views; a leaf's
            # AccumulateGrad copies a non-contiguous view into its own .grad).
            dks.extend(dk_j[None].to(k.dtype).split(sizes, dim=2) if need_kv else [None] * len(sizes))
            dvs.extend(dv_j[None].to(v.dtype).split(sizes, dim=2) if need_kv else [None] * len(sizes))
        return (dq.to(q.dtype), None, None, None, *dks, *dvs)


def query_backward_fits() -> bool:
    """Whether a constant prompt state's CPU backward takes `_query_backward` rather than the flash backward: with one
    thread, or unless OMP_WAIT_POLICY is PASSIVE, where each small op wakes sleeping threads (docs/benchmarks.md)."""
    return torch.get_num_threads() == 1 or os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE"


def _query_backward(d_out, row, q, k, v, lse, scale: float):
    """dq (N, M, D) alone of one non-causal chunk, q (N, M, D), k/v (N, c, D), in tiles of ≤ `QUERY_TILE` scores: p =
    exp(s − lse), dS = p * (dO Vᵀ − row), dq = scale · dS K: three products where the flash backward runs five."""
    n, m, _ = q.shape
    keys = max(1, min(k.shape[1], KEY_BLOCK))  # an empty chunk: no tile runs
    rows = min(m, max(1, QUERY_TILE // (n * keys)))
    dq, tile, neg_lse = torch.zeros_like(q), q.new_empty(2, n * rows * keys), -lse.unsqueeze(-1)  # tiles reused
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        for key0 in range(0, k.shape[1], keys):
            key1 = min(k.shape[1], key0 + keys)
            shape = (n, r1 - r0, key1 - key0)
            p, ds = (tile[i, : n * shape[1] * shape[2]].view(shape) for i in (0, 1))
            torch.baddbmm(neg_lse[:, r0:r1], q[:, r0:r1], k[:, key0:key1].transpose(-1, -2), alpha=scale, out=p).exp_()
            torch.bmm(d_out[:, r0:r1], v[:, key0:key1].transpose(-1, -2), out=ds)
            ds.sub_(row[:, r0:r1].unsqueeze(-1)).mul_(p)
            dq[:, r0:r1].baddbmm_(ds, k[:, key0:key1], alpha=scale)
    return dq


def _piece_backward(ctx, j: int, d_out, d_lse, row, q, out, lse, k, v, need_kv: bool, fold):
    """dq (N, M, D), dk and dv (N, c, D) (None unless need_kv) of one piece of run j, keys k/v (1, N, c, D), with its
    run's kernel (dropout is 0: its random state is never read). A piece longer than `BACKWARD_KEYS` (one long chunk:
    a walk's path, `PromptState.attach_path`) goes in pieces of that many keys, their gradients joined (not a causal
    one: its rows and keys are aligned). fold: out with d_lse folded in for the CPU op (`fold_lse_gradient`) or None."""
    if k.shape[2] > BACKWARD_KEYS and not ctx.causal:
        cut = range(0, k.shape[2], BACKWARD_KEYS)
        parts = [_piece_backward(ctx, j, d_out, d_lse, row, q, out, lse, k[:, :, a: a + BACKWARD_KEYS],
                                 v[:, :, a: a + BACKWARD_KEYS], need_kv, fold) for a in cut]
        dq = torch.stack([p[0] for p in parts]).sum(0)
        dk, dv = (torch.cat([p[i] for p in parts], dim=1) if need_kv else None for i in (1, 2))
        return dq, dk, dv
    scale, causal = ctx.scale, ctx.causal
    if ctx.kernels[j] == "cpu_flash" and not need_kv and not causal and query_backward_fits():
        acc = out.dtype
        return _query_backward(d_out, row, q.to(acc), k[0].to(acc), v[0].to(acc), lse, scale), None, None
    if ctx.kernels[j] != "portable":  # the ops work in q's dtype, with an fp32 log-sum-exp for bf16/fp16
        try:
            return fused_backward(ctx.kernels[j], d_out.to(q.dtype), d_lse, q, k, v, out.to(q.dtype),
                                  lse if lse.dtype == q.dtype else lse.float(), scale, causal, ctx.aux[j], fold)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as err:
            refused(ctx.kernels[j], q, err, "backward")
    return _portable_backward(d_out, row, q.to(out.dtype), k[0].to(out.dtype), v[0].to(out.dtype), lse, scale, causal,
                              need_kv)


def _continues(a: torch.Tensor, b: torch.Tensor) -> bool:
    """b (1, N, c_b, D) follows a (1, N, c_a, D) along dim 2 in one storage (views of one `PromptState._slab`)."""
    return (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.dtype == b.dtype
            and a.stride() == b.stride() and a.shape[:2] == b.shape[:2] and a.shape[3] == b.shape[3]
            and b.storage_offset() == a.storage_offset() + a.shape[2] * a.stride(2))


def adjacent_runs(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> list[_Run]:
    """Runs of prefix chunks that are adjacent views of one tensor (`PromptState._slab`), each as one view over the
    run and its chunks' key counts: (key (1, N, c, D), value (1, N, c, D), [c_1, ...]). No copy, and no autograd
    history (built on the tensors' data inside the autograd function): `ChunkAttention` makes one kernel call per run
    and splits a run's gradient back into its chunks."""
    runs: list[_Run] = []
    first = 0
    for i in range(1, len(keys) + 1):  # linear: decoding scans a layer's chunks at every step
        if i < len(keys) and _continues(keys[i - 1], keys[i]) and _continues(values[i - 1], values[i]):
            continue
        sizes = [t.shape[2] for t in keys[first:i]]
        if i - first == 1:
            runs.append((keys[first], values[first], sizes))
        else:
            runs.append((_extend(keys[first], sum(sizes)), _extend(values[first], sum(sizes)), sizes))
        first = i
    return runs


def _pieces(k: torch.Tensor, v: torch.Tensor, sizes: list[int], limit: int) -> list[_Run]:
    """A run (key (1, N, c, D), value, its chunks' key counts) as consecutive pieces of whole chunks with at most
    `limit` keys each (a longer chunk is a piece of its own): views, no copy."""
    out: list[_Run] = []
    group: list[int] = []
    start = end = 0  # the current piece: keys [start, end), chunks `group`
    for size in [*sizes, None]:
        if group and (size is None or end - start + size > limit):
            out.append((k[:, :, start:end], v[:, :, start:end], group))
            start, group = end, []
        if size is not None:
            group.append(size)
            end += size
    return out


def _extend(head: torch.Tensor, keys: int) -> torch.Tensor:
    """head (1, N, c, D) viewed over `keys` keys of its storage from its start (the following chunks': `_continues`)."""
    return head.detach().as_strided((*head.shape[:2], keys, head.shape[3]), head.stride(), head.storage_offset())


def prefix_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, prefix_keys: list[torch.Tensor],
                     prefix_values: list[torch.Tensor], scale: float, causal: bool = True,
                     context_shards: ContextShards | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of new tokens over [prefix ; own tokens], exactly merged.

    query (B, H, T, D); key/value (B, Hkv, S, D); prefix chunks (1, Hkv, c_j, D) shared by all B.
    causal=True (training, capture): S == T and token t sees own tokens 0 … t. Right padding needs no mask
    beyond causality: a real token never sees a later (padding) position. causal=False (decoding one token
    per sequence, T == 1): the query sees all S own tokens. Returns (B, H, T, D).
    context_shards: a context-parallel group (`state.sharding.ContextShards`) when the prefix is sharded over ranks
    (this rank's chunks are `prefix_keys`, possibly none): the partial results of all ranks are merged by log-sum-exp.
    sinks: (H,) attention sinks (`with_sinks`), added once after every key part is merged; differentiable."""
    b, h, t, d = query.shape
    hkv, s = key.shape[1], key.shape[2]
    if causal and s != t:
        raise ValueError(f"causal own attention needs as many keys as queries, got {s} keys for {t} queries")
    g = h // hkv
    # Own tokens: repeat the segment's own K/V to H heads (small: S tokens) and fold (B, H) into N.
    q_own = query.reshape(b * h, t, d)
    k_own = key.repeat_interleave(g, dim=1).reshape(1, b * h, s, d)
    v_own = value.repeat_interleave(g, dim=1).reshape(1, b * h, s, d)
    out, lse = ChunkAttention.apply(q_own, scale, causal, 1, k_own, v_own)
    out, lse = out.view(b, hkv, g, t, d), lse.view(b, hkv, g, t)
    if not prefix_keys and context_shards is None:
        if sinks is not None:
            out = with_sinks(out, lse, sinks.view(1, hkv, g, 1))
        return out.to(query.dtype).reshape(b, h, t, d)
    # Prefix: fold batch, group and time into one row set (module docstring), (B, Hkv, g, T, D) -> (Hkv, B*g*T, D).
    q_rows = query.view(b, hkv, g, t, d).permute(1, 0, 2, 3, 4).reshape(hkv, b * g * t, d)
    n = len(prefix_keys)
    if context_shards is None:
        p_out, p_lse = ChunkAttention.apply(q_rows, scale, False, n, *prefix_keys, *prefix_values)
    else:
        # Every rank must take part in the backward all-reduce of q's gradient, even without chunks of its own.
        q_rows = context_shards.reduce_grad(q_rows)
        like_out = q_rows.new_zeros(hkv, b * g * t, prefix_values[0].shape[-1] if n else d, dtype=lse.dtype)
        if n:
            p_out, p_lse = ChunkAttention.apply(q_rows, scale, False, n, *prefix_keys, *prefix_values)
        else:
            p_out = like_out + 0 * q_rows.sum().to(lse.dtype)  # zero, but in the graph of q_rows
            p_lse = torch.full_like(like_out[..., 0], torch.finfo(lse.dtype).min)
        p_out, p_lse = context_shards.merge(p_out, p_lse, like_out, like_out[..., 0])
    p_out = p_out.view(hkv, b, g, t, d).permute(1, 0, 2, 3, 4)  # (B, Hkv, g, T, D)
    p_lse = p_lse.view(hkv, b, g, t).permute(1, 0, 2, 3)  # (B, Hkv, g, T)
    total = torch.logaddexp(lse, p_lse)
    merged = torch.exp(lse - total).unsqueeze(-1) * out + torch.exp(p_lse - total).unsqueeze(-1) * p_out
    if sinks is not None:
        merged = with_sinks(merged, total, sinks.view(1, hkv, g, 1))
    return merged.to(query.dtype).reshape(b, h, t, d)


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Add attention sinks to a merged softmax: out (..., D) and its log-sum-exp lse (...) over every key, sinks a
    per-head logit broadcastable to lse. A sink (gpt-oss' `s_aux`) is one more log-sum-exp part with out = 0 and
    lse = sink: out * exp(lse - logaddexp(lse, sink)), in out's dtype, differentiable in the (trainable) sinks."""
    total = torch.logaddexp(lse, sinks.to(lse.dtype))
    return out * torch.exp(lse - total).unsqueeze(-1)


def naive_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, prefix_keys: list[torch.Tensor],
                    prefix_values: list[torch.Tensor], scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Plain reference for `prefix_attention` (same shapes, sinks (H,)): `naive.naive_masked_prefix_attention` with
    the prefix chunks at positions 0 … P−1, the own keys after them and the queries at the last T positions."""
    prefix, start = [], 0
    for k, v in zip(prefix_keys, prefix_values):
        prefix.append((start, k, v))
        start += k.shape[2]
    end = start + key.shape[2]
    q_pos = torch.arange(end - query.shape[2], end, device=query.device)
    own_pos = torch.arange(start, end, device=query.device)
    return naive_masked_prefix_attention(query, key, value, prefix, scale, q_pos, own_pos, sinks=sinks)[0]


# --- The masked path: sliding windows, DSA top-k selection, latent (MLA) prefixes, logit soft-capping --------
# These need a per-(query, key) mask or a per-chunk transform of the prefix, which the fused kernel does not take: plain
# PyTorch, a masked softmax per key part merged by log-sum-exp, each prefix chunk under activation checkpointing (only
# the query and the state stay saved, never a chunk's scores or an expanded MLA chunk). Masked scores use the dtype's
# most negative finite value (as transformers' eager path does): a row that sees nothing in one part gets weight
# exp(lse_part - lse_total) = 0 exactly in the merge, with no NaN in forward or backward.


def _masked_part(q, k, v, visible, scale: float, softcap: float | None, expand):
    """q (B, H, T, D); k/v (Bk, Hkv, c, Dk/Dv) or MLA latents if `expand`; visible (Bv, T, c) bool.
    Returns out (B, H, T, Dv) and lse (B, H, T), in the accumulation dtype."""
    if expand is not None:
        k, v = expand(k, v)  # (1, H, c, Dk), (1, H, c, Dv)
    acc = accumulation_dtype(q.dtype)
    g = q.shape[1] // k.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    with torch.autocast(q.device.type, enabled=False):  # in `acc` under a caller's autocast too (TRL's bf16=True)
        scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale  # (B, H, T, c)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~visible[:, None], torch.finfo(acc).min)
        lse = torch.logsumexp(scores, dim=-1)  # (B, H, T)
        out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.to(acc))
    return out, lse


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window: int | None,
             chunk: int | None = None) -> torch.Tensor:
    """(T, c) bool: query at q_pos sees key at k_pos (causal, and within the sliding window if any:
    transformers' rule is k > q - window; and in the same attention chunk if any: k // chunk == q // chunk)."""
    seen = torch.ones(q_pos.numel(), k_pos.numel(), dtype=torch.bool, device=q_pos.device)
    if causal:
        seen &= k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        seen &= k_pos[None, :] > q_pos[:, None] - window
    if chunk is not None:
        seen &= k_pos[None, :] // chunk == q_pos[:, None] // chunk
    return seen


def masked_prefix_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            prefix: list[tuple[int, torch.Tensor, torch.Tensor]], scale: float, q_pos: torch.Tensor,
                            own_pos: torch.Tensor, window: int | None = None, select: torch.Tensor | None = None,
                            expand=None, softcap: float | None = None, sinks: torch.Tensor | None = None,
                            chunk: int | None = None) -> torch.Tensor:
    """Attention of new tokens over [prompt chunks ; own tokens] with positions, windows and selections.

    query (B, H, T, D) at absolute positions q_pos (T,); own key/value (B, Hkv, S, D*) at own_pos (S,), seen
    causally; prefix: (start, key, value) per prompt chunk, each (1, Hkv, c, D*) — or MLA latents
    (1, 1, c, d) turned into K/V by `expand(latent, rope_key)`. window: sliding window (keys k > q − window).
    select: (B, T, P' + S) bool, DSA's chosen keys over [prompt ; own] (P' = positions before own_pos[0]).
    softcap: tanh logit soft-capping. sinks: (H,) attention sinks (`with_sinks`; not soft-capped), added after the
    merge. chunk: chunked attention (Llama-4's `attention_chunk_size`): a query sees the keys of its own chunk of
    positions only. Returns (B, H, T, Dv). Plain reference: `naive.py`."""
    b, h, t, _ = query.shape
    parts = []
    p_len = int(own_pos[0]) if own_pos.numel() else 0
    for start, pk, pv in prefix:
        c = pk.shape[2]
        k_pos = torch.arange(start, start + c, device=query.device)
        visible = _visible(q_pos, k_pos, causal=True, window=window, chunk=chunk)[None]  # (1, T, c)
        if select is not None:
            visible = visible & select[:, :, start : start + c]
        if not bool(visible.any()):
            continue  # the whole chunk is outside every query's window, attention chunk or selection
        args = (query, pk, pv, visible, scale, softcap, expand)
        grad = torch.is_grad_enabled()
        parts.append(torch.utils.checkpoint.checkpoint(_masked_part, *args, use_reentrant=False) if grad else
                     _masked_part(*args))
    visible = _visible(q_pos, own_pos, causal=True, window=window, chunk=chunk)[None]
    if select is not None:
        visible = visible & select[:, :, p_len : p_len + own_pos.numel()]
    parts.append(_masked_part(query, key, value, visible, scale, softcap, None))
    if len(parts) == 1:
        out, total = parts[0]
    else:
        lse = torch.stack([lse for _, lse in parts])  # (n, B, H, T)
        total = torch.logsumexp(lse, dim=0)
        out = sum(torch.exp(l - total).unsqueeze(-1) * o for (o, _), l in zip(parts, lse))
    if sinks is not None:
        out = with_sinks(out, total, sinks.view(1, h, 1))
    return out.to(query.dtype)
