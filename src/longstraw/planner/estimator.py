"""One planning question (`PlanInputs`) and one plan's answer (`PlanEstimate`): `estimate`, `largest_prompt`,
`plan_all`. How the peak is composed: the package docstring (`longstraw.planner`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from longstraw.choices import DTYPE_BYTES
from longstraw.plan import PLANS_BASELINE_FIRST, Plan, plan_named
from longstraw.planner.formulas import (
    MASKED_MIXERS,
    chunk_activation_bytes,
    last_state_layer,
    masked_layers,
    masked_score_bytes,
    math_attention_score_bytes,
    recurrent_capture_bytes,
    segment_activation_bytes,
    standard_checkpointed_activation_bytes,
    standard_checkpointed_step_bytes,
    state_parts,
)
from longstraw.planner.recurrent import RecurrentBytes, _recurrent_layers, recurrent_bytes
from longstraw.planner.spec import ModelSpec

MIB = 1024**2  # the package's byte units (peak meter, reports, benches import them from the planner)
GIB = 1024**3

# The step memory a fresh CPU process adds beyond its tensors (thread pools, BLAS/oneDNN workspaces, the
# autograd engine's threads). Measured, not derived: 20-22 MiB on every b1-llama configuration of Bench B1
# (the residual of the formulas below), 11 MiB on tiny-llama. On CUDA it is not counted by
# max_memory_allocated; there `reserve_bytes` (CUDA context, NCCL buffers, allocator fragmentation) applies.
CPU_RUNTIME_BYTES = 20 * MIB
DEFAULT_CUDA_RESERVE = 2 * GIB
# Assumed query-block of a DSA indexer scoring a prompt (fp32 scores, reduced over indexer heads).
DSA_SCORE_ROWS = 256


@dataclass(frozen=True)
class PlanInputs:
    """One planning question. Sizes in tokens; gpu_memory and reserve in bytes (reserve None: the device's
    default, CPU_RUNTIME_BYTES on cpu, DEFAULT_CUDA_RESERVE on cuda)."""

    prompt_tokens: int
    response_tokens: int
    group_size: int
    dtype: str = "bf16"
    gpus: int = 1
    gpu_memory: int = 96 * 10**9
    cp: int = 1
    # Tensor parallelism (distributed/tp.py): groups of tp GPUs hold the model split by heads and MLP columns, the
    # embeddings and output projection by vocabulary; FSDP shards over gpus / tp. Per GPU: weights, gradients,
    # optimizer state, the prompt state's K/V and the log-prob's logits block / tp; activations are counted whole
    # (the hidden states between modules are replicated; an over-estimate of the per-head and MLP parts).
    tp: int = 1
    shard: bool = True  # FSDP/ZeRO-3 over the GPUs (when gpus > 1)
    micro_batch: int = 1
    chunk_size: int = 2048
    token_chunk: int = 1024
    optimizer: str = "adamw"
    device: str = "cuda"
    reserve: int | None = None
    checkpoint_layers: bool = False  # per-layer activation checkpointing (backward_group(checkpoint="layers"))
    offload_state: bool = False  # prompt state + its gradient in host memory (backward_group(offload_state=True))
    keep_prompt_graph: int = 0  # exact: trailing capture chunks whose graph is kept (backward_group(keep_prompt_graph))
    # FSDP gathering of LongStraw's plans (detach, exact), `distributed.fsdp.sharded_compute`'s gather: "all" (every
    # parameter and the full gradient through the step) or "layer" (the decoder layers one at a time through FSDP's
    # hooks; the embeddings and output projection gathered, with their full gradient, through the step).
    fsdp_gather: str = "all"
    # Of response_tokens, those an environment appended (an agent's tool results), masked from the loss: they run
    # through the model as generated tokens do, but LongStraw's replay computes no log-prob for them
    # (`logprobs.selected_logprobs`), so detach's and exact's log-prob transient counts the loss tokens only.
    observation_tokens: int = 0
    # exact: loss tokens in one prompt-backward chunk (a prefix tree's inner nodes score their own response turns
    # while they are recomputed; a group's prompt scores none): that chunk's backward holds their log-prob transient.
    prompt_loss_tokens: int = 0


@dataclass
class PlanEstimate:
    """Per-GPU bytes of one plan: `components` (sizes, each held on the GPU within its peak phase), `phases`
    (resident + each phase's transient), `total` (the peak: resident + the largest phase, plus the optimizer; never
    below a component), `step_bytes` (what a bench measures: the peak above the loaded weights, no optimizer state),
    `host_bytes` (the offloaded prompt state and its gradient: host memory of each GPU's process, not GPU memory)."""

    plan: str
    components: dict[str, int]
    phases: dict[str, int]
    peak_phase: str
    total_bytes: int
    step_bytes: int
    fits: bool
    prompt_state_bytes: int
    within_positions: bool = True  # P + R <= the model's max_position_embeddings (LongStraw refuses beyond it)
    host_bytes: int = 0


def _trailing_tokens(positions: int, chunk: int, n: int) -> int:
    """Tokens in the last n capture chunks of `positions` (the last chunk holds the remainder)."""
    if n <= 0:
        return 0
    last = positions - (math.ceil(positions / chunk) - 1) * chunk
    return min(positions, last + (n - 1) * chunk)


@dataclass(frozen=True)
class _Step:
    """The sizes one estimate works with: b: parameter bytes, a: accumulation bytes, p, r, g: prompt, response
    and group, shards: FSDP shards, n, d, v: this GPU's parameters, the hidden size, this GPU's vocabulary rows,
    layer: the largest layer's parameters on this GPU."""

    b: int
    a: int
    p: int
    r: int
    g: int
    shards: int
    n: int
    d: int
    v: int
    layer: int


@dataclass(frozen=True)
class _Resident:
    """The per-GPU bytes outside the activations: weights, gradients, optimizer moments, FSDP's gathered
    parameters, the per-layer reduce-scatter's buffers (gather="layer"), the runtime's reserve."""

    weights: int
    grads: int
    optimizer: int
    gathered: int
    layer_reduce: int
    runtime: int

    @property
    def held(self) -> int:
        """What the GPU holds through every phase."""
        return self.weights + self.optimizer + self.runtime + self.gathered


def _step_sizes(spec: ModelSpec, inp: PlanInputs) -> _Step:
    if inp.dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {inp.dtype!r}: use one of {', '.join(DTYPE_BYTES)}")
    b = DTYPE_BYTES[inp.dtype]
    if inp.tp < 1 or inp.gpus % inp.tp:
        raise ValueError(f"tp = {inp.tp} must be >= 1 and divide the GPUs ({inp.gpus})")
    fsdp = inp.gpus // inp.tp  # FSDP's ranks: the GPUs with the same tensor-parallel index
    return _Step(
        b=b, a=max(4, b),  # accumulation dtype of attention merges and optimizer moments
        p=inp.prompt_tokens, r=inp.response_tokens, g=inp.group_size,
        shards=fsdp if inp.shard and fsdp > 1 else 1,
        n=math.ceil(spec.params / inp.tp), d=spec.hidden, v=math.ceil(spec.vocab / inp.tp),
        layer=math.ceil(spec.max_layer_params / inp.tp),
    )


def _resident(spec: ModelSpec, inp: PlanInputs, plan: Plan, z: _Step) -> _Resident:
    n, b, shards = z.n, z.b, z.shards
    weights = grads = n * b // shards
    if inp.optimizer == "adamw":
        optimizer = n * (8 + (4 if b < 4 else 0)) // shards  # exp_avg, exp_avg_sq (+ fp32 master weights)
    elif inp.optimizer == "none":
        optimizer = 0
    else:
        raise ValueError(f"unknown optimizer {inp.optimizer!r}: adamw or none")
    gathered = (2 * max(z.layer, z.v * z.d) + z.layer) * b if shards > 1 else 0
    if inp.fsdp_gather not in ("all", "layer"):
        raise ValueError(f"fsdp_gather must be 'all' or 'layer', got {inp.fsdp_gather!r}")
    if shards > 1 and plan.captures_state and inp.fsdp_gather == "all":
        # LongStraw under FSDP (its trainer and the TRL drop-in: `distributed.fsdp.sharded_compute`) gathers every
        # parameter once for the whole block and reduce-scatters the gradient once at its end: during the step a
        # rank holds the full parameters and the full, unsharded gradient (measured: `bench trl-scale`).
        gathered = n * b
        grads = n * b
    layer_reduce = 0
    if shards > 1 and plan.captures_state and inp.fsdp_gather == "layer":
        # sharded_compute(gather="layer"): the units that are not decoder layers (embeddings, final norm, output
        # projection; one V·d matrix when tied) stay gathered through the block with their full gradient; of the
        # layers, the one computing and the one FSDP prefetches in backward are gathered, and a layer's unsharded
        # gradient lives until its reduce-scatter after each backward through it: FSDP copies it into a flat input
        # (L), allocates the rank's output (L / gpus), and gloo (device cpu) works on another copy of the input.
        held = (z.v * z.d * (1 if spec.tied else 2) + z.d) * b
        layer = z.layer * b
        gathered = held + 2 * layer
        grads = (n * b - held) // shards + held  # the layers' gradient sharded, the held units' whole
        layer_reduce = layer + layer + layer // shards + (layer if inp.device == "cpu" else 0)
    default = CPU_RUNTIME_BYTES if inp.device == "cpu" else DEFAULT_CUDA_RESERVE
    runtime = inp.reserve if inp.reserve is not None else default
    return _Resident(weights, grads, optimizer, gathered, layer_reduce, runtime)


def _logprob_bytes(spec: ModelSpec, inp: PlanInputs, z: _Step, rows: int) -> int:
    """The fused log-prob pass's transient for `rows` scored rows (`engine/linear_loss.py`): a block of c rows (its
    logits, softmax, then gradient, in place; a soft-cap's slope beside them) and the (V, d) weight gradient."""
    c = min(inp.token_chunk, rows)
    slope = c * z.v * z.a if spec.logit_softcap else 0
    if z.a > z.b:  # bf16/fp16: fp32 logits beside the model-dtype product, then beside the gradient's cast
        return c * z.v * (z.a + z.b) + slope + z.v * z.d * z.b  # (precision.py)
    return c * z.v * z.b + slope + z.v * z.d * z.b


def _state_on_device(spec: ModelSpec, inp: PlanInputs, plan: Plan, z: _Step) -> tuple[int, int, int]:
    """(prompt state, its gradient, bytes in host memory) of a plan that captures a prompt state."""
    exact, p = plan.needs_chunk_boundaries, z.p
    parts = state_parts(spec, p - 1, z.b, inp.chunk_size, exact)
    state, state_grad = parts.per_rank(inp.cp, inp.tp)
    host = 0
    if inp.offload_state:
        host = state + state_grad
        if inp.checkpoint_layers:
            # One layer's copy of its attention part is on the device at a time (replay: the whole prefix;
            # prompt backward: the chunks before chunk j, plus chunk j's gradient of every layer brought over),
            # plus the recurrent states being read. Measured by counting the live copies within 5%
            # (tests/engine/state/test_offload.py).
            layer = math.ceil(parts.largest_layer / inp.cp)
            # On a GPU the next attention layer's copies are prefetched on a side stream while a layer computes
            # (state/prompt.py): two layers' copies at once (measured by counting with prefetch forced on).
            held = 2 if inp.device != "cpu" else 1
            copies = held * layer
            if exact:
                f = min(inp.chunk_size, p - 1) / (p - 1)
                copies = max(held * layer, math.ceil(held * layer * (1 - f) + parts.attention_grad / inp.cp * f))
            state = copies + (parts.recurrent_grad if exact else parts.recurrent)  # one boundary's worth
            state_grad = (layer + parts.recurrent_grad) if exact else 0
        # else: every layer's copy is saved for the backward: the whole state is on the device anyway
    return state, state_grad, host


def _replay_bytes(spec: ModelSpec, inp: PlanInputs, plan: Plan, z: _Step, m: _Resident, comp: dict[str, int]) -> int:
    """A replay micro-batch's forward+backward above the resident bytes (records its components in `comp`)."""
    b, a, r, g, v, d = z.b, z.a, z.r, z.g, z.v, z.d
    k = min(inp.micro_batch, g)
    acts = segment_activation_bytes(spec, b, a, plan.peak_key, r, k, inp.checkpoint_layers)
    acts += masked_score_bytes(spec, a, r, min(inp.chunk_size, z.p - 1), k, inp.checkpoint_layers)
    # With checkpointing, the recurrent layers' recompute terms come after the log-prob's transient has ended
    # (measured: a checkpointed replay of b1-mamba2 / b1-qwen3-next peaks in its log-prob, every layer holding
    # its input only): they count against it with a max (attention-only models: acts).
    during_logprob = (segment_activation_bytes(spec, b, a, plan.peak_key, r, k, True, scans=False)
                      if inp.checkpoint_layers else acts)
    logprob = _logprob_bytes(spec, inp, z, k * max(r - inp.observation_tokens, 1))  # rows the head scores
    dsa = any(mixer == "dsa" for mixer in spec.mixers)
    indexer = DSA_SCORE_ROWS * math.ceil(z.p / inp.cp) * 4 if dsa else 0
    steady = math.ceil(g / k) > 1  # gradients already resident while the next micro-batch runs
    # The backward's tail: the embedding's dense (V, d) gradient; with tied embeddings the output projection's
    # (V, d) gradient also waits in autograd's input buffer until it is summed with it.
    tail = (2 if spec.tied else 1) * v * d * b
    forward_backward = max(during_logprob + logprob + indexer, acts)
    comp.update(replay_activations=acts, logprob_chunk=logprob)
    if dsa:
        comp["indexer_scores"] = indexer
    if steady:
        return m.grads + max(forward_backward, tail)
    return max(forward_backward, m.grads + (v * d * b if spec.tied else 0))


def _capture_bytes(spec: ModelSpec, inp: PlanInputs, z: _Step) -> tuple[int, list[RecurrentBytes]]:
    """(a capture chunk's transient, the recurrent layers' `recurrent_bytes` of one chunk)."""
    b, d, p = z.b, z.d, z.p
    chunk = min(inp.chunk_size, p - 1)
    capture = chunk * (3 * spec.intermediate + 4 * d + 2 * spec.heads * max(spec.head_dim, 1)) * b
    # Recurrent layers: the chunk's transient through their scans.
    recurrent = [recurrent_bytes(spec, spec.mixers[i], chunk, b) for i in _recurrent_layers(spec)]
    if recurrent:
        capture = max(capture, recurrent_capture_bytes(spec, p - 1, b, inp.chunk_size))
    if masked_layers(spec):  # the masked path's no-grad score tensors of one (chunk x chunk) part
        capture = max(capture, 3 * spec.heads * chunk * chunk * z.a + 4 * chunk * d * b)
    return capture, recurrent


def _prompt_backward(spec: ModelSpec, inp: PlanInputs, z: _Step, recurrent: list[RecurrentBytes],
                     comp: dict[str, int]) -> tuple[int, int]:
    """(the kept capture graphs' bytes, the prompt backward's transient above the resident bytes, the gradients and
    the state) of the exact plan (records its components in `comp`)."""
    b, a, d, p = z.b, z.a, z.d, z.p
    chunk = min(inp.chunk_size, p - 1)
    kernel = "replay" if p - 1 > inp.chunk_size else "own"
    chunk_acts = (segment_activation_bytes(spec, b, a, kernel, chunk, 1, True) if inp.checkpoint_layers
                  else chunk_activation_bytes(spec, b, a, kernel, chunk)
                  + max((x.backward for x in recurrent), default=0))
    # backward transient of one layer (gradients of its MLP input/intermediate), measured ~ (I + d)·b
    backward_transient = 0
    if not inp.checkpoint_layers:  # (with checkpointing the layer's backward buffers are counted above)
        backward_transient = chunk * (spec.intermediate + d) * b
        chunk_acts += backward_transient
    attending = masked_layers(spec) - (spec.mixers[last_state_layer(spec)] in MASKED_MIXERS)
    chunk_acts += masked_score_bytes(spec, a, chunk, chunk if p - 1 > inp.chunk_size else 0, 1,
                                     inp.checkpoint_layers, attending)
    # Kept capture graphs: the last N chunks' saved activations, from capture to backward (the first ones the prompt
    # backward reaches): the capture and the replays hold them all, and the backward of the last chunk runs with all of
    # them alive plus its own transient. A kept chunk holds what its forward saved: every layer's activations, or with
    # checkpointing every layer's input (L·d·b per token); its backward adds the rest of `chunk_acts`.
    saved = (chunk * spec.num_layers * d * b if inp.checkpoint_layers else chunk_acts - backward_transient)
    kept_tokens = _trailing_tokens(p - 1, inp.chunk_size, inp.keep_prompt_graph)
    kept = math.ceil(saved * kept_tokens / chunk)
    if kept:
        comp["kept_prompt_graphs"] = kept
    if inp.prompt_loss_tokens:
        chunk_acts += _logprob_bytes(spec, inp, z, inp.prompt_loss_tokens)
    recompute = chunk_acts if kept_tokens < p - 1 else 0
    first = kept + chunk_acts - saved if kept else 0  # the last chunk's backward, every kept graph alive
    comp["prompt_backward_chunk"] = chunk_acts
    return kept, max(recompute, first)


def _gradient_reduce(inp: PlanInputs, z: _Step) -> int:
    """The block's end under FSDP (`sharded_compute`): the largest unit's reduce-scatter buffers."""
    # Every FSDP unit reduce-scatters its gradient, one at a time, while the full parameters and gradient are still
    # held (the state and activations are gone). The largest unit: the embedding or output projection (V·d, each a
    # unit of its own) or a decoder layer (gather="layer": only the units that are not layers). FSDP copies its
    # gradient into a flat input (U) and allocates the rank's output (U / gpus); gloo (device cpu) copies the input
    # again. Measured 2.5 U on 2 CPU processes (`bench trl-scale`); U·(1 + 1/gpus) on CUDA is assumed (docs/planner.md).
    unit = (max(z.layer, z.v * z.d) if inp.fsdp_gather == "all" else z.v * z.d) * z.b
    return unit + unit // z.shards + (unit if inp.device == "cpu" else 0)


def _state_plan_phases(spec: ModelSpec, inp: PlanInputs, plan: Plan, z: _Step, m: _Resident,
                       comp: dict[str, int], phases: dict[str, int]) -> tuple[int, int]:
    """Fill `phases` and `comp` for a plan that captures a prompt state; (prompt state, host bytes)."""
    state, state_grad, host = _state_on_device(spec, inp, plan, z)
    comp.update(prompt_state=state, state_gradients=state_grad)
    replay = _replay_bytes(spec, inp, plan, z, m, comp)
    capture, recurrent = _capture_bytes(spec, inp, z)
    phases["capture"] = m.held + state + capture
    phases["replay"] = m.held + state + state_grad + replay + m.layer_reduce
    if plan.needs_chunk_boundaries:
        kept, backward = _prompt_backward(spec, inp, z, recurrent, comp)
        phases["capture"] += kept
        phases["replay"] += kept
        phases["prompt_backward"] = m.held + m.grads + state + state_grad + backward + m.layer_reduce
    if z.shards > 1:
        reduce = _gradient_reduce(inp, z)
        phases["gradient_reduce"] = m.held + m.grads + reduce
        comp["fsdp_reduce"] = reduce
    return state, host


def _standard_plan_phases(spec: ModelSpec, inp: PlanInputs, plan: Plan, z: _Step, m: _Resident,
                          comp: dict[str, int], phases: dict[str, int]) -> None:
    """Fill `phases` and `comp` for a plan that runs whole prompt+response sequences."""
    b, a, p, r, g = z.b, z.a, z.p, z.r, z.g
    seqs = g if plan.batched else 1
    if inp.checkpoint_layers:  # what the step holds at its layers' high point (counted inside `step` below)
        acts = standard_checkpointed_activation_bytes(spec, b, a, p + r, seqs)
    else:
        acts = segment_activation_bytes(spec, b, a, plan.peak_key, p + r, seqs, False)
        acts += math_attention_score_bytes(spec, p + r, seqs, b, list(range(spec.num_layers)))
    # the log-softmax output, its gradient, the logits' gradient (whole V: tensor parallelism gathers them here)
    logits = 3 * seqs * r * spec.vocab * b
    steady = not plan.batched and g > 1  # gradients already resident while the next sequence runs
    if inp.checkpoint_layers:
        step = standard_checkpointed_step_bytes(spec, b, a, p + r, seqs, logits, m.grads, steady)
    else:
        step = (m.grads + max(acts + logits, acts)) if steady else max(acts + logits, acts, m.grads)
    phases["forward_backward"] = m.held + step
    comp.update(prompt_state=0, sequence_activations=acts, logits=logits)


def estimate(spec: ModelSpec, inp: PlanInputs, plan: str | Plan) -> PlanEstimate:
    """One plan's predicted per-GPU memory for `inp` (composition: `longstraw.planner`); `plan`: a Plan or its name."""
    plan = plan_named(plan)
    z = _step_sizes(spec, inp)
    m = _resident(spec, inp, plan, z)
    comp: dict[str, int] = {"weights": m.weights, "gradients": m.grads, "optimizer": m.optimizer}
    phases: dict[str, int] = {}
    if plan.captures_state:
        prompt_state, host = _state_plan_phases(spec, inp, plan, z, m, comp, phases)
    else:
        _standard_plan_phases(spec, inp, plan, z, m, comp, phases)
        prompt_state, host = 0, 0
    if m.gathered:
        comp["fsdp_gathered"] = m.gathered
    comp["runtime"] = m.runtime
    peak_phase = max(phases, key=lambda k: phases[k])
    total = phases[peak_phase]
    within = not spec.max_positions or z.p + z.r <= spec.max_positions
    return PlanEstimate(
        plan=plan.name, components=comp, phases=phases, peak_phase=peak_phase, total_bytes=total,
        step_bytes=total - m.weights - m.optimizer, fits=within and total <= inp.gpu_memory,
        prompt_state_bytes=prompt_state, within_positions=within, host_bytes=host,
    )


def largest_prompt(spec: ModelSpec, inp: PlanInputs, plan: str | Plan, limit: int = 2**34) -> int | None:
    """The largest prompt length (tokens) for which `plan` fits `inp.gpu_memory`; None if not even 2 fits,
    `limit` if everything up to it fits. Memory grows monotonically with P, so a binary search suffices."""
    def fits(p: int) -> bool:
        return estimate(spec, replace(inp, prompt_tokens=p), plan).fits

    if not fits(2):
        return None
    if fits(limit):
        return limit
    lo, hi = 2, limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def plan_all(
    spec: ModelSpec, inp: PlanInputs, plans: tuple[str | Plan, ...] = PLANS_BASELINE_FIRST,
) -> dict[str, object]:
    """Every plan's estimate and largest fitting prompt, as the JSON document `longstraw plan --json` prints (and
    its table shows): the baseline, standard_batched, first."""
    out = {str(plan): dict(asdict(estimate(spec, inp, plan)), largest_prompt_tokens=largest_prompt(spec, inp, plan))
           for plan in plans}
    return {
        "model": {
            "name": spec.name, "model_type": spec.model_type, "params": spec.params,
            "expert_params": spec.expert_params, "layers": spec.num_layers, "max_positions": spec.max_positions,
            "layer_kinds": {k: spec.mixers.count(k) for k in dict.fromkeys(spec.mixers)},
        },
        "inputs": asdict(inp),
        "plans": out,
    }
