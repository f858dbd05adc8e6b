"""The planner's bytes of recurrent mixers (gated DeltaNet / KDA, Mamba2, Mamba-1, lightning attention) per segment."""

from __future__ import annotations

from dataclasses import dataclass

from longstraw.planner.spec import LINEAR_SCAN_CHUNK, ModelSpec


def _padded(tokens: int, chunk: int) -> int:
    """`tokens` rounded up to a multiple of `chunk` (the torch scans pad a segment to whole chunks)."""
    return -(-tokens // chunk) * chunk


@dataclass(frozen=True)
class RecurrentBytes:
    """Bytes of one recurrent token mixer (gated DeltaNet/KDA: `linear`; Mamba2) over a segment of `batch` rows of
    `tokens` tokens, counted on transformers' torch paths (`torch_chunk_gated_delta_rule`, Mamba2's
    `torch_forward`/`mamba2_chunk_scan`; no flash-linear-attention or mamba_ssm kernels, which keep far less).
    Both scans pad the segment to whole chunks of their own (`LINEAR_SCAN_CHUNK`, the config's Mamba2 chunk size),
    so a 128-token replay through a 256-chunk Mamba2 scan costs 256 tokens in every scan-sized tensor.

    saved: what autograd saves for the backward in a forward with grad. tail: of it, what is saved after the layer's
    state is produced (gated norm, output projection): a prompt-backward chunk whose forward stops at the last
    layer's state does not save it. nograd: the live transient of a no-grad forward of the layer (the capture).
    backward: the transient of its backward beyond the saved tensors. (The conv window and state the segment cache
    keeps are copies of a few columns, counted with the state: `_recurrent_bytes`.)"""

    saved: int
    tail: int
    nograd: int
    backward: int


RECURRENT_MIXERS = ("linear", "mamba", "attention+mamba", "mamba1", "lightning")


def _linear_bytes(spec: ModelSpec, tokens: int, b: int) -> RecurrentBytes:
    """`RecurrentBytes` of one row of a gated DeltaNet / KDA (`linear`) mixer (see `recurrent_bytes`)."""
    kd, vd = spec.lin_key_heads * spec.lin_key_dim, spec.lin_value_heads * spec.lin_value_dim
    conv, hv = 2 * kd + vd, spec.lin_value_heads
    w = max(vd, hv * spec.lin_key_dim)  # q/k repeated to the value heads, v: Hv x d per token
    c = LINEAR_SCAN_CHUNK
    state = hv * spec.lin_key_dim * spec.lin_value_dim * 4
    tp = _padded(tokens, c)
    nc = tp // c
    # Saved (per-layer saved-tensor hooks on b1-qwen3-next at T = 100, 128, 700, 704, 2048: within -1 … +8%):
    # the conv input and the conv's output (2 x conv_dim, param dtype); ~20 fp32 tensors of Hv x d (q/k/v made
    # contiguous, normalised, padded, k·beta, v·beta, the UT solve's outputs, decayed q/k, the core output, the
    # gated norm's), counted per real token: a padded segment saves no more of them than an unpadded one (700
    # tokens saved less than 704); six fp32 intra-chunk (c x c) matrices per value head (decays, k·kᵀ, q·kᵀ, the
    # UT system), per padded token; three recurrent states per chunk.
    saved = tokens * (2 * conv * b + 20 * w * 4) + tp * 6 * hv * c * 4 + 3 * nc * state
    tail = tokens * (5 * vd * 4 + vd * b)  # gated RMSNorm (fp32) and the output projection's input
    # No grad: the in_proj outputs, the conv input and its activation, three c x c matrices and ~9 Hv x d fp32
    # tensors alive at the chunk loop (measured: 26.7 KB per token with the residual stream; this 25.7 KB).
    in_proj = 2 * kd + 2 * vd + 2 * hv
    nograd = tokens * ((in_proj + 2 * conv) * b + 9 * w * 4) + tp * 3 * hv * c * 4
    backward = tp * hv * c * 4
    return RecurrentBytes(saved, tail, nograd, backward)


def _mamba2_bytes(spec: ModelSpec, tokens: int, b: int, batch: int, cached: bool) -> RecurrentBytes:
    """`RecurrentBytes` of one row of a Mamba2 mixer (`mamba`, `attention+mamba`'s heads): see `recurrent_bytes`."""
    h, hd, n = spec.mamba_heads, spec.mamba_head_dim, spec.mamba_state
    inner = h * hd
    conv = inner + 2 * spec.mamba_groups * n
    proj = inner + conv + h  # in_proj output: gate, x/B/C, dt
    c = spec.mamba_chunk
    state = h * hd * n * 4
    tp = _padded(tokens, c)
    nc = tp // c
    # Counted on `mamba2_chunk_scan` with saved-tensor hooks (b1-mamba2: 104.96 KB per token and layer at T = 2048,
    # 168.8 KB at T = 128, i.e. 256 padded; tiny-mamba2 and a 768-wide, 24-head, N = 128 shape within 1.3%): per token
    # the in_proj output, the conv input (cached: concatenated with the window), its output and activation, the gated
    # norm's four fp32 tensors and the output projection's input, dt; per padded token three fp32 (c x c) matrices per
    # head (the decay L, C·Bᵀ, the masked product copied for bmm), B and C repeated to the heads with their bmm copies
    # (5 x H·N; 3 with a single chunk), four H x hd tensors (3 with a single chunk); two chunk states per chunk.
    multi = batch * nc > 1
    per_token = proj * b + (3 if cached else 2) * conv * b + 4 * inner * 4 + inner * b + 3 * h * 4
    per_padded = (3 * c + (5 if multi else 3) * n + (4 if multi else 3) * hd + 2) * h * 4
    saved = tokens * per_token + tp * per_padded + 2 * (nc + 1) * state
    tail = tokens * (4 * inner * 4 + inner * b)
    # No grad, measured on the three shapes at T = 2048 (89.6 / 32.9 / 194.9 KB per token with the residual
    # stream; this gives 90.7 / 33.4 / 196.7): the in_proj output, the conv input and activation; the scan's
    # L, C·Bᵀ and their product (locals alive to its end), B and C padded and repeated (3 x H·N) and ~8 H x hd
    # tensors (x·dt, D·x, the diagonal and off-diagonal outputs and their bmm operands).
    nograd = tokens * (proj + 2 * conv) * b + tp * (3 * c + 3 * n + 8 * hd) * h * 4
    # Backward beyond the saved tensors: about one c x c gradient per head (measured 12.2-18.4 KB per token
    # on the three shapes at T = 2048; this 8.2-24.6 KB).
    backward = tp * h * c * 4
    return RecurrentBytes(saved, tail, nograd, backward)


def _mamba1_bytes(spec: ModelSpec, tokens: int, b: int, cached: bool) -> RecurrentBytes:
    """`RecurrentBytes` of one row of a Mamba-1 mixer (see `recurrent_bytes`)."""
    # Mamba-1 (`engine/hf/mamba1.py`, `kernels/selective_scan.py`), counted from the code (not measured): per token the
    # in_proj output, the conv input, output and activation, dt, B, C, gate and output projection input (~8 x the
    # inner width in the param dtype) and a few fp32 vectors of it; decays and inputs (2 x inner x N, fp32 or
    # wider), with the replay's doubling scan ~2 log2(SCAN_CHUNK) = 8 more and the states, or with transformers'
    # sequential loop (the standard plans) about two.
    inner, n, w = spec.mamba_heads * spec.mamba_head_dim, spec.mamba_state, max(4, b)
    scan = (11 if cached else 4) * inner * n * w + inner * n * b
    saved = tokens * (8 * inner * b + 4 * inner * w + scan)
    tail = tokens * inner * b
    nograd = tokens * (5 * inner * b + 3 * inner * n * w)
    backward = tokens * 2 * inner * n * w
    return RecurrentBytes(saved, tail, nograd, backward)


def _lightning_bytes(spec: ModelSpec, tokens: int, b: int, cached: bool) -> RecurrentBytes:
    """`RecurrentBytes` of one row of a MiniMax lightning attention mixer (see `recurrent_bytes`)."""
    # MiniMax's lightning attention. Continuing a state (the cached segments: capture after the first chunk,
    # replays) it runs token by token, and each token's output q_t S_t reads a new (H, d, d) state S_t, which
    # autograd saves: one state per token. Without a state (the standard plans) it runs blocks of
    # `LIGHTNING_BLOCK`: per block the decayed intra-block scores (H x block x block) and two states, per token
    # the decayed query. Both: the activated q/k/v projection and its input, the RMSNorm (fp32) and the output
    # gate. `saved` measured with saved-tensor hooks on one float64 layer (4 heads of 32): cached at 64 and 128
    # tokens within 0.1%, uncached at 256 and 512 within 2%; the rest is counted from transformers' code.
    h, d = spec.lin_value_heads, spec.lin_key_dim
    state = h * d * d * b
    per_token = 2 * 3 * h * d * b + 5 * h * d * 4 + 2 * h * d * b
    if cached:
        saved = tokens * (per_token + state)
    else:
        blocks = -(-tokens // LIGHTNING_BLOCK)
        saved = tokens * (per_token + h * d * b) + blocks * (h * LIGHTNING_BLOCK * LIGHTNING_BLOCK * b + 2 * state)
    tail = tokens * (5 * h * d * 4 + 2 * h * d * b)
    nograd = tokens * 3 * 3 * h * d * b + 3 * state
    backward = 2 * state + tokens * 3 * h * d * b
    return RecurrentBytes(saved, tail, nograd, backward)


def recurrent_bytes(spec: ModelSpec, mixer: str, tokens: int, b: int, batch: int = 1,
                    cached: bool = True) -> RecurrentBytes:
    """`RecurrentBytes` of a `linear`, `mamba` or `attention+mamba` (its Mamba2 heads) mixer; zeros otherwise.
    cached: the segment runs through LongStraw's `SegmentCache` (capture, replay, prompt backward); the standard plans
    run the model without a cache (no conv concatenation)."""
    if mixer == "linear":
        one = _linear_bytes(spec, tokens, b)
    elif mixer in ("mamba", "attention+mamba"):
        one = _mamba2_bytes(spec, tokens, b, batch, cached)
    elif mixer == "mamba1":
        one = _mamba1_bytes(spec, tokens, b, cached)
    elif mixer == "lightning":
        one = _lightning_bytes(spec, tokens, b, cached)
    else:
        return RecurrentBytes(0, 0, 0, 0)
    return RecurrentBytes(*(batch * x for x in (one.saved, one.tail, one.nograd, one.backward)))


# MiniMax's lightning-attention block length (its config's `block_size` default, which MiniMax-Text-01 keeps).
LIGHTNING_BLOCK = 256


def _recurrent_layers(spec: ModelSpec) -> list[int]:
    return [i for i, m in enumerate(spec.mixers) if m in RECURRENT_MIXERS]
