"""Mamba-1's selective scan continued from a given SSM state: the plain sequential reference
(`naive_selective_scan`) and the chunked fast path (`selective_scan`) that replays use.

Per channel c of the inner width d and state index n, with dt = softplus(dt_raw + dt_bias):

    h_t[c, n] = exp(dt_t[c] A[c, n]) h_{t-1}[c, n] + dt_t[c] B_t[n] u_t[c]        h_0 = the initial state
    y_t[c]    = (sum_n h_t[c, n] C_t[n] + D[c] u_t[c]) silu(z_t[c])

transformers' torch path (`modeling_mamba.mamba_selective_scan`, which Falcon-Mamba and Jamba copy) computes the same
recurrence but always from a zero state, which is why a replay cannot use it. Both functions here repeat its casts, so
that a segment continued from the state of the tokens before it equals transformers' full forward: A is float32
(`-exp(A_log.float())`), B and u are cast to float32 before they meet dt, dt and the state keep the wider of float32
and the model's dtype, the state is cast back to the model's dtype before it meets C, and D is float32.

Nothing is written in place: the initial state may be a shared (1, d, N) tensor that every row of the batch reads
(broadcast), and it may be an autograd leaf (the exact plan differentiates with respect to it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Tokens per chunk of the fast path: each chunk's states come from log2(SCAN_CHUNK) vectorised doubling steps
# (Hillis-Steele), the chunks follow one another.
SCAN_CHUNK = 16


def _discretize(u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, dt_bias: torch.Tensor | None,
                upcast: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """u, dt (b, d, T), A (d, N), B (b, T, N) -> decay exp(dt A) and input dt B u, both (b, d, T, N), in the dtypes
    transformers' scan uses (the wider of float32 and the model's dtype; B and u cast to `upcast` first)."""
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)[..., None]
    dt = F.softplus(dt)
    decay = torch.exp(A[None, :, None, :] * dt[..., None])
    inputs = dt[..., None] * B[:, None, :, :].to(upcast) * u[..., None].to(upcast)
    return decay, inputs


def _finish(states_out: torch.Tensor, u: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None) -> torch.Tensor:
    """states_out (b, d, T) = sum_n h C -> y (b, d, T): the D skip term and the silu(z) gate."""
    if D is not None:
        states_out = states_out + u * D[None, :, None]
    if z is not None:
        states_out = states_out * F.silu(z)
    return states_out


def naive_selective_scan(
    u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor | None = None, z: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None, upcast: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token at a time, as transformers' sequential loop, but from `initial_state`. u, dt, z (b, d, T); A (d, N);
    B, C (b, T, N); D, dt_bias (d,); initial_state (1 or b, d, N) or None (zeros).
    upcast: the dtype B and u are cast to before they meet dt (transformers: float32; a float64 test of the math
    itself passes float64, where float32 casts would round the gradients). Returns y (b, d, T) and the state after
    the last token (b, d, N)."""
    batch, width, length = u.shape
    decay, inputs = _discretize(u, dt, A, B, dt_bias, upcast)
    state = (torch.zeros(batch, width, A.shape[-1], dtype=u.dtype, device=u.device) if initial_state is None
             else initial_state.expand(batch, -1, -1))
    outputs = []
    for t in range(length):
        state = decay[:, :, t] * state + inputs[:, :, t]
        outputs.append(torch.matmul(state.to(u.dtype), C[:, t, :, None])[..., 0])  # (b, d)
    return _finish(torch.stack(outputs, dim=-1), u, D, z), state


def _chunk_states(decay: torch.Tensor, inputs: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """decay, inputs (b, d, L, N), state (1 or b, d, N) before the chunk -> the states after each token (b, d, L, N).
    Doubling scan: after the step of stride k, position t holds the product of the decays over (t - 2k, t] and the
    recurrence's value over that window from a zero state; after ceil(log2 L) steps every window reaches the chunk's
    start, and the state before the chunk enters through the decays' product."""
    step = 1
    length = decay.shape[2]
    while step < length:
        inputs = torch.cat([inputs[:, :, :step], decay[:, :, step:] * inputs[:, :, :-step] + inputs[:, :, step:]], 2)
        decay = torch.cat([decay[:, :, :step], decay[:, :, step:] * decay[:, :, :-step]], 2)
        step *= 2
    return inputs + decay * state[:, :, None]


def selective_scan(
    u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor | None = None, z: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None, upcast: torch.dtype = torch.float32, chunk: int = SCAN_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`naive_selective_scan`'s result (same arguments and shapes), `chunk` tokens at a time: within a chunk the
    states come from a vectorised doubling scan (every product of decays is <= 1, so nothing overflows), and each
    chunk starts from the last state of the one before. Equal to the reference up to float reassociation."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    batch, width, length = u.shape
    decay, inputs = _discretize(u, dt, A, B, dt_bias, upcast)
    state = (torch.zeros(1, width, A.shape[-1], dtype=u.dtype, device=u.device) if initial_state is None
             else initial_state)
    outputs = []
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        states = _chunk_states(decay[:, :, start:end], inputs[:, :, start:end], state)  # (b, d, L, N)
        # (b, L, d, N) @ (b, L, N, 1): the state in the model's dtype against C, as transformers' loop does
        out = torch.matmul(states.transpose(1, 2).to(u.dtype), C[:, start:end, :, None])[..., 0]
        outputs.append(out.transpose(1, 2))  # (b, d, L)
        state = states[:, :, -1]
    if length == 0:
        state = state.expand(batch, -1, -1)
        y = u.new_zeros(batch, width, 0)
    else:
        y = torch.cat(outputs, dim=-1)
    return _finish(y, u, D, z), state
