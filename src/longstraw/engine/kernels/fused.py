"""The fused attention ops `ChunkAttention` runs one key chunk with, and the kernel choice per device and dtype.

Three fused ops of torch compute softmax(q K^T * scale) V *and* its log-sum-exp in one call, which the exact
merge of a prefix part with an own part needs (torch's public SDPA does not return the log-sum-exp):

* ``cpu_flash``: ``_scaled_dot_product_flash_attention_for_cpu`` (any head dim, fp64/fp32/bf16/fp16);
* ``cuda_flash``: ``_scaled_dot_product_flash_attention`` (fp16/bf16, head dim a multiple of 8 and <= 256);
* ``cuda_efficient``: ``_scaled_dot_product_efficient_attention`` (fp32, or fp16/bf16 head dims flash refuses).

Everything else (fp64 on CUDA, other devices, a refusal at run time) takes the portable blocked kernel in
`attention.py`, the reason logged once per (kernel, dtype, head dim). One layout: q (N, M, D), k/v (1, N, c, D) (N
heads, M query rows, c keys), batch 1 with N heads to the ops. Their backward ops take no log-sum-exp gradient;
`fused_backward` folds it in exactly. The CUDA paths have not run on a GPU yet: the CPU suite checks them against
emulations built from the CPU op (the CUDA ops' head-dim and log-sum-exp-padding rules asserted) and their calls
against the real ops' schemas on the meta device (tests/engine/kernels/test_fused.py); tests/gpu/ runs them on CUDA."""

from __future__ import annotations

import logging
from typing import Any

import torch

from longstraw.engine.precision import REDUCED

log = logging.getLogger(__name__)


def _aten_op(name: str):
    try:
        return getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return None


# Private ATen ops (present in torch >= 2.2); None where a build lacks one, which routes to the portable kernel.
_FLASH_CPU = _aten_op("_scaled_dot_product_flash_attention_for_cpu")
_FLASH_CPU_BWD = _aten_op("_scaled_dot_product_flash_attention_for_cpu_backward")
_FLASH_CUDA = _aten_op("_scaled_dot_product_flash_attention")
_FLASH_CUDA_BWD = _aten_op("_scaled_dot_product_flash_attention_backward")
_EFFICIENT_CUDA = _aten_op("_scaled_dot_product_efficient_attention")
_EFFICIENT_CUDA_BWD = _aten_op("_scaled_dot_product_efficient_attention_backward")

KERNELS = ("cpu_flash", "cuda_flash", "cuda_efficient", "portable")
FLASH_MAX_HEAD_DIM = 256  # the CUDA flash kernels' limit, after padding
_logged: set[tuple[str, str]] = set()
# (kernel, device type, dtype, head dim) an op refused at run time: later calls go to the portable kernel at once.
_refusals: set[tuple[str, str, torch.dtype, int]] = set()


def _log_once(key: str, reason: str) -> None:
    if (key, reason) not in _logged:
        _logged.add((key, reason))
        log.warning("longstraw attention: %s", reason)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def choose_kernel(q: torch.Tensor, enabled: bool = True) -> str:
    """The fused op for q's device, dtype and head dim, else "portable" (reason logged once on CUDA). The head-dim
    check is on D + 1 because the backward appends one column (`fused_backward`): a head dim of 256 takes the
    memory-efficient op in both directions rather than mixing kernels."""
    if not enabled:
        return "portable"
    d = q.shape[-1]
    if q.device.type == "cpu":
        return "cpu_flash" if _FLASH_CPU is not None and _FLASH_CPU_BWD is not None else "portable"
    if q.device.type != "cuda":
        return "portable"
    key = f"{q.dtype}/D={d}"

    def usable(kernel: str) -> bool:
        return (kernel, q.device.type, q.dtype, d) not in _refusals

    if (q.dtype in REDUCED and _FLASH_CUDA is not None and round_up(d + 1, 8) <= FLASH_MAX_HEAD_DIM
            and usable("cuda_flash")):
        return "cuda_flash"
    if q.dtype in (*REDUCED, torch.float32) and _EFFICIENT_CUDA is not None and usable("cuda_efficient"):
        return "cuda_efficient"
    _log_once(key, f"no fused CUDA attention op takes {q.dtype} (head dim {d}): using the portable blocked "
                   "kernel (a Python loop over key blocks; slow at long prompts). Use bf16, fp16 or fp32.")
    return "portable"


def refused(kernel: str, q: torch.Tensor, err: Exception, where: str = "forward") -> None:
    """An op refused these inputs at run time: log it once; route later calls with this device, dtype and head dim past
    it (`choose_kernel`: the other CUDA op if any, else the portable kernel, which the caller runs for this chunk)."""
    _refusals.add((kernel, q.device.type, q.dtype, q.shape[-1]))
    _log_once(f"{kernel}/{q.dtype}/D={q.shape[-1]}",
              f"{kernel} ({where}) refused {q.dtype} head dim {q.shape[-1]} ({str(err).splitlines()[0][:200]}); "
              "using the portable blocked kernel for it")


def _pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """Zero columns up to `width` in the last dim. No copy when already that wide and the last dim is dense, which
    is all the ops need: the state's chunks are (1, Hkv, c, D) views of transformers' (1, c, Hkv, D) projections,
    and a copy of each chunk per call would cost the state's size in traffic every decoding step."""
    extra = width - t.shape[-1]
    if extra == 0:
        return t if t.stride(-1) == 1 else t.contiguous()
    return torch.cat([t, t.new_zeros(*t.shape[:-1], extra)], dim=-1)


def fused_forward(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  causal: bool) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """One key chunk: q (N, M, D), k/v (1, N, c, D) -> out (N, M, D) in q's dtype, lse (N, M) fp32 (fp64 for
    fp64 inputs), and what the op's backward needs besides (its random-state outputs; None on CPU).

    The CUDA ops need the head dim padded to a multiple of 8: zero columns in q and k leave every score
    unchanged, zero columns in v give zero output columns, which are cut off again."""
    d, m = q.shape[-1], q.shape[-2]
    if kernel == "cpu_flash":
        out, lse = _FLASH_CPU(q[None], k, v, 0.0, causal, scale=scale)
        return out[0], lse[0], None
    w = round_up(d, 8)
    if kernel == "cuda_flash":
        out, lse, _, _, _, _, rng_state, unused, _ = _FLASH_CUDA(
            _pad(q[None], w), _pad(k, w), _pad(v, w), 0.0, causal, False, scale=scale)
        return out[0, ..., :d], lse[0], (rng_state, unused)
    if kernel == "cuda_efficient":
        out, lse, seed, offset = _EFFICIENT_CUDA(
            _pad(q[None], w), _pad(k, w), _pad(v, w), None, True, 0.0, causal, scale=scale)
        return out[0, ..., :d], lse[0, :, :m], (seed, offset)  # its lse is padded to a multiple of 32 rows
    raise ValueError(f"unknown fused kernel {kernel!r}: one of {KERNELS[:-1]}")


def fold_lse_gradient(d_out: torch.Tensor, out: torch.Tensor, d_lse: torch.Tensor) -> torch.Tensor | None:
    """out' = out − (dLSE / |dO|²)·dO per row (one tensor, out's dtype), d_out/out (N, M, D), d_lse (N, M): rowsum(dO *
    out') = rowsum(dO * out) − dLSE, the only use the CPU flash backward makes of out, so dLSE enters at D (D + 1: ~25%
    slower). None in half precision (out' rounds coarsely) or for a row with dLSE ≠ 0 and |dO|² below the normals."""
    if out.dtype not in (torch.float32, torch.float64):
        return None
    if not bool(d_lse.any()):
        return out
    norm = d_out.square().sum(-1)  # (N, M)
    tiny = torch.finfo(out.dtype).tiny
    if bool(((norm < tiny) & (d_lse != 0)).any()):
        return None
    return torch.addcmul(out, (d_lse.to(out.dtype) / norm.clamp_min(tiny)).unsqueeze(-1), d_out, value=-1.0)


def fused_backward(kernel: str, d_out: torch.Tensor, d_lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, scale: float, causal: bool,
                   aux: Any, folded: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one key chunk given the *global* out/lse (N, M, D)/(N, M), with a log-sum-exp gradient
    d_lse (N, M) folded in. q (N, M, D), k/v (1, N, c, D). Returns dq (N, M, D), dk/dv (N, c, D), q's dtype. folded:
    on CPU, `fold_lse_gradient`'s out', formed once per call by the caller (None: the extra column).

    A flash backward forms dS = P * (dP − rowsum(dO * O)) with P = exp(s − lse). Appending one column — dO' = [dO, 1],
    O' = [O, −dLSE], zero columns to q, k, v — leaves P and dP unchanged and turns the row sum into rowsum(dO * O) −
    dLSE, exactly the gradient with dLSE included (on CPU `fold_lse_gradient` folds it in at D where it can). The global
    lse makes P this chunk's slice of the full softmax: per-chunk gradients add up. The scale is explicit as the head
    dim grew (CUDA: to a multiple of 8; CPU: D + 1); the padded k/v are copies of ≤ `attention.BACKWARD_KEYS` keys."""
    d, m = q.shape[-1], q.shape[-2]
    if kernel == "cpu_flash" and folded is not None:
        dq, dk, dv = _FLASH_CPU_BWD(d_out[None], q[None], k, v, folded[None], lse[None], 0.0, causal, scale=scale)
        return dq[0], dk[0], dv[0]
    w = d + 1 if kernel == "cpu_flash" else round_up(d + 1, 8)
    d_out_aug = _pad(torch.cat([d_out, d_out.new_ones(*d_out.shape[:-1], 1)], dim=-1), w)[None]
    out_aug = _pad(torch.cat([out, -d_lse.unsqueeze(-1).to(out.dtype)], dim=-1), w)[None]
    q_aug, k_aug, v_aug = _pad(q, w)[None], _pad(k, w), _pad(v, w)
    if kernel == "cpu_flash":
        dq, dk, dv = _FLASH_CPU_BWD(d_out_aug, q_aug, k_aug, v_aug, out_aug, lse[None], 0.0, causal, scale=scale)
    elif kernel == "cuda_flash":
        rng_state, unused = aux
        dq, dk, dv = _FLASH_CUDA_BWD(d_out_aug, q_aug, k_aug, v_aug, out_aug, lse[None], None, None, m,
                                     k.shape[-2], 0.0, causal, rng_state, unused, scale=scale)
    elif kernel == "cuda_efficient":
        seed, offset = aux
        lse_rows = lse.new_zeros(lse.shape[0], round_up(m, 32))  # the op reads its own padded layout
        lse_rows[:, :m] = lse
        dq, dk, dv, _ = _EFFICIENT_CUDA_BWD(d_out_aug, q_aug, k_aug, v_aug, None, out_aug, lse_rows[None], seed,
                                            offset, 0.0, [True, True, True, False], causal, scale=scale)
    else:
        raise ValueError(f"unknown fused kernel {kernel!r}: one of {KERNELS[:-1]}")
    return dq[0, ..., :d], dk[0, ..., :d], dv[0, ..., :d]
