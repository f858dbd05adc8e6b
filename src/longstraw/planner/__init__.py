"""Memory planner behind `longstraw plan`: per-GPU bytes of one GRPO step for every plan, before renting GPUs.

From a transformers config (a preset, a built-in description of a paper-scale model, a directory or
`config.json`, or a cached hub id) this module derives a `ModelSpec` (layer kinds, dimensions, parameter counts
from a meta-device instantiation: no weights are allocated) and predicts, per plan, the peak of one
`backward_group` call plus the optimizer state that lives beside it.

How the peak is composed (`PlanEstimate.phases`): a resident part (weights, optimizer, prompt state and its
gradient, runtime) plus the largest of the phases a step goes through:

* capture (detach/exact): the state being built + one no-grad chunk's transient tensors;
* replay (detach/exact): the saved activations of one micro-batch of k responses + the chunked log-prob's
  transient (forward: logits and logsumexp's temporary, 2·c·V; backward: recomputed logits + the output
  projection's weight-gradient temporary, c·V + V·d). Parameter gradients are resident from the second
  micro-batch on; with a single micro-batch they grow while activations are freed (max, not sum);
* prompt backward (exact): one chunk's activations recomputed with grad (the last layer stops at its K/V)
  + the state gradient;
* standard: the activations of full `P + R` sequences (one, or all G when batched) + three `[R, V]`
  log-softmax tensors alive at the start of the backward.

Activation bytes per token and layer are counted from the tensors autograd saves in transformers' layers and
in LongStraw's attention kernel (RMSNorm: an fp32 copy of the input + the normalised input + the weighted
output, (4 + 2b)·width; SwiGLU MLP: 4·I·b; attention through `prefix_attention`: q, k and v repeated to H
heads, q regrouped for the prefix, the output projection's input (5·H·D·b) and two partial outputs in the
accumulation dtype (2·H·D·a); standard attention through SDPA: (2·H·D + 2·Hkv·D)·b). Full-attention
families (llama, qwen2/3, mistral) are validated against measured peaks (tests/planner/test_planner.py); the
formulas for linear attention, Mamba2, MLA, DSA and MoE layers are counted the same way from transformers'
torch paths. Recurrent layers (gated DeltaNet, Mamba2: `RecurrentBytes`) are counted per segment, padded to
their scan's chunk, with the no-grad capture's transient and the backward's; b1-mamba2 and b1-qwen3-next
(3 gated-DeltaNet + 1 attention layer, MoE) are validated against measured peaks for standard, detach and exact
with and without checkpointing (within 10%, slow test; bench/results/memory-b1-*-recurrent-20261130.json).
The prompt-state formulas of every family are pinned exactly against captured states
(tests/engine/state/test_architectures.py).

Multi-GPU assumptions: FSDP/ZeRO-3 divides weights, gradients and optimizer state over the GPUs and gathers
one decoder layer at a time (two in flight: prefetch) plus that layer's unsharded gradient; MoE experts are
assumed expert-parallel (sharded, never gathered). LongStraw's plans with `fsdp_gather="all"` (what
`distributed.fsdp.sharded_compute` does) instead hold every parameter gathered and the full gradient through the
step, and end with the `gradient_reduce` phase: the largest unit's reduce-scatter buffers on top of both
(`estimator.estimate`). Context parallelism `cp` divides the attention part of the
prompt state (and its gradient) of detach/exact over `cp` GPUs; every rank keeps all recurrent states (each runs
every chunk, `StateBytes.per_rank`); the standard plans are not context-parallel.

Memory levers, as the engine implements them: `checkpoint_layers` (activation_checkpointing: each layer's input, plus
one layer's activations and backward buffers while it is recomputed) and `offload_state` (the state and its gradient
in host memory, one layer's copies on the device; saves nothing without checkpointing).

The package, by what each module holds (every name of the former single module `planner.py`, private helpers
included, is still importable from `longstraw.planner` itself):

* `spec`: `ModelSpec`, `load_config`, the built-in descriptions, parameter counting;
* `families`: `spec_from_config`, one reader per model family; `config_fields`: the fields they share;
* `formulas`: the prompt state's and the activations' bytes per layer (`StateBytes`, the segment and
  standard-plan checkpointed terms);
* `recurrent`: the recurrent token mixers' bytes over a segment (`RecurrentBytes`, `recurrent_bytes`);
* `estimator`: `PlanInputs`, `PlanEstimate`, `estimate`, `largest_prompt`, `plan_all`;
* `cli`: `longstraw plan`'s options, `format_plan`, `run_from_args`.
* `parsing`: the argument types, `parse_size`, `positive_int`, `non_negative_int`.
"""

from __future__ import annotations

from longstraw.choices import PLANS
from longstraw.planner.cli import add_arguments, format_plan, inputs_from_args, run_from_args
from longstraw.planner.estimator import (
    CPU_RUNTIME_BYTES,
    DEFAULT_CUDA_RESERVE,
    DSA_SCORE_ROWS,
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
    StateBytes,
    chunk_activation_bytes,
    layer_activation_bytes,
    model_activation_bytes,
    recurrent_capture_bytes,
    segment_activation_bytes,
    standard_checkpointed_step_bytes,
    state_bytes,
    state_parts,
)
from longstraw.planner.parsing import non_negative_int, parse_size, positive_int
from longstraw.planner.recurrent import RECURRENT_MIXERS, RecurrentBytes, recurrent_bytes
from longstraw.planner.spec import (
    BUILTIN_NAMES,
    LINEAR_SCAN_CHUNK,
    MAMBA_SCAN_CHUNK,
    PLANNER_MODEL_TYPES,
    ModelSpec,
    glm5_class,
    hybrid_27b,
    load_config,
)

__all__ = [
    # spec
    "BUILTIN_NAMES", "LINEAR_SCAN_CHUNK", "MAMBA_SCAN_CHUNK", "PLANNER_MODEL_TYPES", "ModelSpec", "glm5_class",
    "hybrid_27b", "load_config", "spec_from_config",
    # formulas
    "RECURRENT_MIXERS", "RecurrentBytes", "StateBytes", "chunk_activation_bytes", "layer_activation_bytes",
    "model_activation_bytes", "recurrent_bytes", "recurrent_capture_bytes", "segment_activation_bytes",
    "standard_checkpointed_step_bytes", "state_bytes", "state_parts",
    # estimator
    "CPU_RUNTIME_BYTES", "DEFAULT_CUDA_RESERVE", "DSA_SCORE_ROWS", "DTYPE_BYTES", "GIB", "MIB", "PLANS",
    "PlanEstimate", "PlanInputs", "estimate", "largest_prompt", "plan_all",
    # cli
    "add_arguments", "format_plan", "inputs_from_args", "parse_size", "non_negative_int", "positive_int",
    "run_from_args",
]
