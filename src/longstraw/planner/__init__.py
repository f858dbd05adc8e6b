"""Memory planner behind `longstraw plan`: per-GPU bytes of one GRPO step for every plan, before renting GPUs.

From a transformers config (a preset, a built-in paper-scale model, a directory or `config.json`, or a cached hub id)
it derives a `ModelSpec` (layer kinds, dimensions, parameter counts from a meta-device instantiation: no weights) and
predicts, per plan, the peak of one `backward_group` call plus the optimizer state beside it. The peak
(`PlanEstimate.phases`): a resident part (weights, optimizer, prompt state and its gradient, runtime) plus the largest
of the phases a step goes through:

* capture (detach/exact): the state being built + one no-grad chunk's transient tensors;
* replay (detach/exact): the saved activations of one micro-batch of k responses + the fused log-prob pass's
  transient (a block of c rows' logits, softmax, then gradient, in place, beside the (V, d) weight gradient: c·V +
  V·d; a soft-cap's slope adds c·V). Parameter gradients are resident from the second micro-batch on; with a single
  micro-batch they grow while activations are freed (max, not sum);
* prompt backward (exact): one chunk's activations recomputed with grad (up to the last layer's K/V) + state gradient;
* standard: the activations of full `P + R` sequences (one, or all G when batched) + three `[R, V]`
  log-softmax tensors alive at the start of the backward.

What each term counts, the multi-GPU assumptions (FSDP/ZeRO-3, `fsdp_gather`, context and tensor parallelism), the
levers and the measurements behind the formulas: docs/planner.md, `formulas` and `recurrent`."""

from __future__ import annotations

from longstraw.choices import PLANS
from longstraw.planner.cli import add_arguments, run_from_args
from longstraw.planner.estimator import (
    DTYPE_BYTES,
    GIB,
    MIB,
    PlanEstimate,
    PlanInputs,
    estimate,
    largest_prompt,
    plan_all,
)
from longstraw.planner.families import spec_from_config
from longstraw.planner.formulas import (
    model_activation_bytes,
    standard_checkpointed_step_bytes,
    state_bytes,
    state_parts,
)
from longstraw.planner.parsing import non_negative_int, parse_size, positive_int
from longstraw.planner.recurrent import RecurrentBytes, recurrent_bytes
from longstraw.planner.spec import BUILTIN_NAMES, ModelSpec, load_config

# What callers use from the package itself; everything else is imported from its module.
__all__ = [
    "BUILTIN_NAMES", "DTYPE_BYTES", "GIB", "MIB", "PLANS", "ModelSpec", "PlanEstimate", "PlanInputs", "RecurrentBytes",
    "add_arguments", "estimate", "largest_prompt", "load_config", "model_activation_bytes", "non_negative_int",
    "parse_size", "plan_all", "positive_int", "recurrent_bytes", "run_from_args", "spec_from_config",
    "standard_checkpointed_step_bytes", "state_bytes", "state_parts",
]
