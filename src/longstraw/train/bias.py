"""The bias meter (`--bias-every N`): how far the detach plan's gradient is from the exact one along a real run.

The detach plan treats the prompt state as a constant, so its gradient misses every path through the prompt's
activations (the source paper's "risk 1"). Every N steps of a `detach` run, `measure` takes the step's own
gradient (the mean over the step's kept groups, before clipping, exactly what the optimizer is about to use),
computes the exact plan's gradient of the same groups at the same weights, and returns

  bias_cosine     cos(g_detach, g_exact) over all parameters as one vector (1 = same direction);
  bias_rel_error  ||g_detach - g_exact|| / ||g_exact|| (0 = no bias);
  bias_norm_ratio ||g_detach|| / ||g_exact|| (< 1: detach sees only part of the gradient);
  time_bias_s     the meter's own time.

It must not change the run: the detach step's `.grad` tensors are put back as the very same objects (the clip and
the optimizer see bit-identical gradients) and every RNG state is restored (a model with active dropout draws). The
exact pass recaptures the prompt (the rollout's state has no chunk boundaries) and allocates one more gradient and
the exact plan's prompt state: a metered step's peak is higher. One process only: under FSDP the gradients are
sharded and reduced at the end of a pass, which the meter would have to repeat; the trainer refuses `bias_every` in a
distributed run."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import torch

from longstraw.api.group import backward_group
from longstraw.engine.group import Group
from longstraw.plan import DETACH, EXACT
from longstraw.train.checkpoints import rng_state, set_rng_state

if TYPE_CHECKING:
    from longstraw.train.config import TrainConfig


def due(cfg: TrainConfig, step: int) -> bool:
    """Whether 0-based `step` is a metered one (steps N, 2N, ... counted from 1)."""
    return cfg.run.bias_every > 0 and (step + 1) % cfg.run.bias_every == 0


def compare_gradients(detach: list[torch.Tensor | None], exact: list[torch.Tensor | None]) -> dict[str, float]:
    """Cosine, relative error and norm ratio of two gradients given per parameter (None = zero), in float64."""
    dot = nd = ne = diff = 0.0
    zero = torch.zeros((), dtype=torch.float64)  # broadcast in place of a missing gradient
    for a, b in zip(detach, exact, strict=True):
        a64 = zero if a is None else a.detach().double()
        b64 = zero if b is None else b.detach().double()
        dot += float((a64 * b64).sum())
        nd += float(a64.square().sum())
        ne += float(b64.square().sum())
        diff += float((a64 - b64).square().sum())
    norm_d, norm_e = math.sqrt(nd), math.sqrt(ne)
    nan = float("nan")  # an all-zero gradient has no direction: reported as NaN, not as a made-up number
    return {
        "bias_cosine": dot / (norm_d * norm_e) if norm_d > 0 and norm_e > 0 else nan,
        "bias_rel_error": math.sqrt(diff) / norm_e if norm_e > 0 else nan,
        "bias_norm_ratio": norm_d / norm_e if norm_e > 0 else nan,
    }


def exact_gradient(model: torch.nn.Module, groups: list[Group], cfg: TrainConfig) -> list[torch.Tensor | None]:
    """The exact plan's mean gradient over `groups` at the model's current weights, per parameter (None = no
    gradient). Leaves `.grad` as it found it (the very tensors) and every RNG state unchanged."""
    params = list(model.parameters())
    saved = [p.grad for p in params]
    rng = rng_state()
    try:
        for p in params:
            p.grad = None
        for group in groups:
            backward_group(model, group, cfg.plan.backward_options(plan=EXACT))
        # The trainer averages its groups' gradients the same way (sum, then divide by the number of groups).
        exact = [p.grad.div_(len(groups)) if p.grad is not None else None for p in params]
    finally:
        for p, g in zip(params, saved):
            p.grad = g
        set_rng_state(rng)
    return exact


def measure(model: torch.nn.Module, groups: list[Group], cfg: TrainConfig) -> dict[str, float]:
    """The bias metrics of this step: the model's `.grad` (the detach step's mean gradient) against the exact
    gradient of the same `groups` at the same weights. See the module docstring."""
    if cfg.plan.plan is not DETACH:  # TrainConfig refuses it; this guards direct callers
        raise ValueError(f"the bias meter compares the detach plan with the exact one; this run's plan is "
                         f"{cfg.plan.plan}")
    t0 = time.perf_counter()
    detach = [p.grad for p in model.parameters()]
    out = compare_gradients(detach, exact_gradient(model, groups, cfg))
    out["time_bias_s"] = time.perf_counter() - t0
    return out
