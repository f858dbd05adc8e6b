"""FSDP2 for LongStraw: shard the unmodified model with `fully_shard`, gather it once per step, reduce once.

`parallelize(model, mesh)` applies `torch.distributed.fsdp.fully_shard` to every decoder layer and then to
the root (embeddings, final norm and the output projection, tied or not, form the root's unit). Model code is
untouched (torchtitan's split: model math here, parallelism in a `parallelize` step).

Why the parameters are gathered once per step instead of layer by layer (FSDP's default):

* FSDP's per-layer all-gathers fire from module forward hooks, so every rank must make the *same number* of
  forward calls in the same order. Our ranks do not: each rank's prompts have their own length (a different
  number of capture / prompt-backward chunks), sampling stops when a rank's own responses end, and dynamic
  sampling may drop a rank's groups. Mismatched all-gathers would pair layer k on one rank with layer j on
  another and silently compute garbage (the layers' shards have the same size) or hang.
* Our replay calls the inner decoder (`model.model`) and reads the output projection's weight directly for the
  chunked log-prob (`engine/plans/replay.py`, `logprobs.py`), outside any module forward: the root's hooks never run,
  so hook-driven unsharding would hand the log-prob a sharded `DTensor` (and give its gradient to nobody).
* Reducing once per step (not once per replay, as required) means every rank holds the full unsharded
  gradient until the reduction anyway, whatever the gathering schedule.

So `sharded_compute(model)` all-gathers every unit once (collectively, at a point every rank reaches), runs
the block with every parameter a plain tensor (no collective inside: ranks may do different work, the
`lm_head` read is just a tensor read, the exact plan's prompt backward and its early-stopping K/V recompute
work as in one process), then reduce-scatters each unit's accumulated gradient once and reshards.
FSDP settings: `reshard_after_forward=False`, `set_reshard_after_backward(False)`,
`set_requires_gradient_sync(False)`: the hooks still run but do no communication. A model another library sharded
(accelerate's FSDP2 for TRL, with its own settings) gets these settings for the block only (`_compute_settings`).

Memory per rank: sharded parameters, gradients and optimizer state at rest (1/W each); during a step, the full
parameters and the full gradient (the price of one reduction per step); plus the prompt state.
Gradients are averaged over ranks (FSDP's default divide-by-world-size); callers scale for their own
normalisation (see `trainer.py`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a transformers causal LM (`model.model.layers`)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(model).__name__} has no model.model.layers: parallelize() shards transformers causal LMs "
            "(LlamaForCausalLM, Qwen3ForCausalLM, ...) layer by layer"
        )
    return list(layers)


def parallelize(model: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:
    """Shard `model` in place over the 1-D `mesh`: one FSDP2 unit per decoder layer, plus the root unit.

    Call on every rank with the same (same-seed or same-checkpoint) model; build the optimizer afterwards, from
    the sharded parameters. Run forwards/backwards inside `sharded_compute(model)`.
    """
    if mesh.ndim != 1:
        raise ValueError(f"parallelize takes a 1-D data-parallel mesh, got {mesh.ndim} dimensions")
    if isinstance(model, FSDPModule):
        raise ValueError("the model is already sharded: call parallelize() once")
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    assert isinstance(model, FSDPModule)
    model.set_reshard_after_backward(False)
    model.set_requires_gradient_sync(False)
    # A rank that computed no gradient for a parameter (e.g. all its groups were dropped) still takes part in
    # the reduce-scatter, with zeros, so that every rank issues the same collectives.
    model.set_reduce_scatter_unused_params(True)
    if mesh.device_type == "cpu":
        # gloo has no AVG reduction: SUM, then FSDP divides by the world size itself.
        model.set_force_sum_reduction_for_comms(True)
    # FSDP picks its root at the first forward through a sharded module. Our replay enters at `model.model`
    # (never through the root's forward), so the first layer would wrongly become a root: fix it now.
    model._get_fsdp_state()._lazy_init()
    return model


def _units(model: torch.nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _reduce_accumulated_gradients(model: FSDPModule) -> None:
    """Reduce-scatter every unit's accumulated unsharded gradient once, into the sharded `.grad`.

    This is what FSDP's own end-of-backward callback (`FSDPState._root_post_backward_final_callback`) does for
    the last micro-batch of a gradient-accumulation loop; we run it after the block instead, because the
    block's "last backward" is inside `backward_group` (a replay or a prompt-backward chunk, depending on the
    plan). Every rank must call this at the same point.
    """
    state = model._get_fsdp_state()
    groups = [g for s in state._state_ctx.all_states for g in s._fsdp_param_groups]
    model.set_requires_gradient_sync(True)
    try:
        for group in reversed(groups):  # backward order, like FSDP's callback
            group.post_backward()
        for group in groups:
            group.finalize_backward()
    finally:
        model.set_requires_gradient_sync(False)


@contextmanager
def sharded_compute(model: torch.nn.Module, reduce: bool = True) -> Iterator[None]:
    """All-gather the parameters once, run the block, then reduce the gradients once and reshard.

    reduce=False (sampling, evaluation: no backward in the block) skips the reduction.

    Inside, parameters are plain tensors and `backward_group` accumulates the rank's own gradient, unsharded;
    at exit every unit reduce-scatters it once (averaged over ranks) into the sharded `.grad`, adding to what
    is there. Every rank must enter and leave the block (collectives at both ends). If the block raises, no
    collective is attempted (another rank may never arrive): the parameters are resharded locally, the
    accumulated gradients are dropped, and the error propagates. A non-FSDP model passes through unchanged.
    """
    if not isinstance(model, FSDPModule):
        yield
        return
    units = _units(model)
    with _compute_settings(model):
        for unit in units:
            unit.unshard()
        try:
            yield
        except BaseException:
            model.reset_iter_state()  # local only: reshard, clear FSDP's per-iteration trackers
            _drop_unsharded_gradients(units)
            raise
        if reduce:
            _reduce_accumulated_gradients(model)
        else:
            _drop_unsharded_gradients(units)
        # Reshard every unit and reset FSDP's per-forward bookkeeping: the K/V-only forwards of capture stop
        # inside the last layer (segment.py), which leaves that layer's FSDP state mid-forward.
        model.reset_iter_state()


@contextmanager
def _compute_settings(model: FSDPModule) -> Iterator[None]:
    """`parallelize`'s settings for the block, whoever sharded the model; the model's own restored after.

    Inside: no resharding after a layer's forward or backward (the block reads parameters outside module forwards),
    no communication from the hooks (`sharded_compute` reduces once), zeros reduce-scattered for unused parameters,
    SUM reductions on gloo (it has no AVG). FSDP's root is fixed first: its lazy initialisation runs at the first
    forward through a sharded module, and the block may enter at an inner module (`model.model`)."""
    state = model._get_fsdp_state()
    state._lazy_init()
    states = state._state_ctx.all_states
    groups = [g for s in states for g in s._fsdp_param_groups]
    names = ("post_forward_mesh_info", "reshard_after_backward", "reduce_grads", "all_reduce_grads",
             "reduce_scatter_unused_params", "force_sum_reduction_for_comms")
    saved = [{name: getattr(g, name) for name in names} for g in groups]
    auto = [s._auto_reshard_after_forward for s in states]
    model.set_reshard_after_forward(False)
    model.set_reshard_after_backward(False)
    model.set_requires_gradient_sync(False)
    model.set_reduce_scatter_unused_params(True)
    for group in groups:
        if group.mesh_info.mesh.device_type == "cpu":
            group.force_sum_reduction_for_comms = True
    try:
        yield
    finally:
        for group, values in zip(groups, saved):
            for name, value in values.items():
                setattr(group, name, value)
        for s, value in zip(states, auto):
            s._auto_reshard_after_forward = value


def _drop_unsharded_gradients(units: list[FSDPModule]) -> None:
    for unit in units:
        for group in unit._get_fsdp_state()._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                fsdp_param.unsharded_accumulated_grad = None
                if hasattr(fsdp_param, "_unsharded_param"):
                    fsdp_param._unsharded_param.grad = None


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """`torch.nn.utils.clip_grad_norm_` for sharded (`DTensor`) gradients: the norm is the global one."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, 2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a sharded `DTensor` (a collective: every rank must call it); others unchanged."""
    return t.full_tensor() if isinstance(t, DTensor) else t
