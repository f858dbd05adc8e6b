"""FSDP2 for LongStraw: shard the unmodified model (`fully_shard`); gather every parameter once per block or per layer.

`parallelize(model, mesh)` applies `torch.distributed.fsdp.fully_shard` to every decoder layer and then to
the root (embeddings, final norm and the output projection, tied or not, form the root's unit). Model code is
untouched (torchtitan's split: model math here, parallelism in a `parallelize` step). A model another library
sharded (accelerate's FSDP2 for TRL, with its own units and settings) gets the block's settings for the block only.

`sharded_compute(model, gather=...)` runs a block of LongStraw work (backward_group calls, sampling) on it.

Gradients are averaged over ranks (FSDP's default); callers scale for their own normalisation (see `trainer.py`)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
from torch.distributed.tensor import DTensor

from longstraw.engine.activation_checkpointing import decoder_layers


def parallelize(model: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:
    """Shard `model` in place over the 1-D `mesh`: one FSDP2 unit per decoder layer, plus the root unit. Call on every
    rank with the same (same-seed or same-checkpoint) model; build the optimizer afterwards, from the sharded
    parameters. Run forwards/backwards inside `sharded_compute(model)`."""
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


def _param_groups(units: list[FSDPModule]) -> list[Any]:
    """The FSDP parameter groups of `units`, each once and in FSDP's order (root first). Modules sharded together
    (accelerate's `fully_shard([final_norm, lm_head])`) are separate units sharing one state and one group."""
    if not units:
        return []
    wanted = {id(unit._get_fsdp_state()) for unit in units}
    states = [s for s in units[0]._get_fsdp_state()._state_ctx.all_states if id(s) in wanted]
    return [g for s in states for g in s._fsdp_param_groups]


def _reduce_accumulated_gradients(units: list[FSDPModule]) -> None:
    """Reduce-scatter the accumulated unsharded gradient of each of `units` (their own parameters, not their children's)
    once, into the sharded `.grad`; every rank at the same point. FSDP's own end-of-backward callback
    (`FSDPState._root_post_backward_final_callback`) does this for the last micro-batch of an accumulation loop; here it
    runs after the block, whose "last backward" is inside `backward_group`."""
    groups = _param_groups(units)
    for group in groups:
        group.reduce_grads = True
    for group in reversed(groups):  # backward order, like FSDP's callback
        group.post_backward()
    for group in groups:
        group.finalize_backward()


@contextmanager
def sharded_compute(model: torch.nn.Module, reduce: bool = True, gather: str = "all") -> Iterator[None]:
    """Run a block of LongStraw work on an FSDP2-sharded model; its gradients reduce-scattered (averaged over ranks)
    into the sharded `.grad`, adding to what is there. A non-FSDP model passes through unchanged.

    gather="all": every parameter all-gathered once, a plain tensor inside the block (`backward_group` accumulates the
    rank's own gradient, unsharded), reduced once and resharded at exit. Ranks may do different work.

    gather="layer": the decoder layers are left to FSDP's own hooks (gathered when a forward or backward reaches one,
    resharded after, its gradient reduce-scattered after each backward: at most two unsharded at a time, the one
    computing and the one prefetched); the other units (the log-prob reads the output projection outside any module
    forward) are gathered for the block and reduced at its end, as with "all". The hooks' collectives fire from inside
    the work, so **every rank must run the same forwards and backwards**, as the ranks of one context-parallel group
    do (`distributed.context`); the caller checks it (`check_same_work`).

    reduce=False (sampling, evaluation: no backward) skips the reduction. Every rank must enter and leave the block
    (collectives at both ends). If the block raises, no collective is attempted (another rank may never arrive): the
    parameters are resharded locally, the unreduced gradients dropped, and the error propagates."""
    if gather not in ("all", "layer"):
        raise ValueError(f"gather must be 'all' or 'layer', got {gather!r}")
    if not isinstance(model, FSDPModule):
        yield
        return
    units: list[FSDPModule] = [m for m in model.modules() if isinstance(m, FSDPModule)]
    layers = _layer_units(model) if gather == "layer" else []
    gathered = [u for u in units if u not in layers]
    with _block_settings(model, layers):
        for unit in gathered:
            unit.unshard()
        try:
            yield
        except BaseException:
            model.reset_iter_state()  # local only: reshard, clear FSDP's per-iteration trackers
            _drop_unsharded_gradients(units)
            raise
        if reduce:
            _reduce_accumulated_gradients(gathered)
        else:
            _drop_unsharded_gradients(gathered)
        # Reshard every unit and reset FSDP's per-forward bookkeeping (capture's K/V-only forwards leave it mid-forward)
        model.reset_iter_state()


def _layer_units(model: torch.nn.Module) -> list[FSDPModule]:
    """The FSDP units that are decoder layers (the children of `model`'s `layers` list, wrapped or not by PEFT)."""
    lists = [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] == "layers"
             and isinstance(m, torch.nn.ModuleList)]
    if len(lists) != 1:
        raise ValueError(f"gather='layer' needs one list of decoder layers (a ModuleList named 'layers'), found "
                         f"{len(lists)} in {type(model).__name__}")
    layers: list[FSDPModule] = [m for m in lists[0] if isinstance(m, FSDPModule)]
    if not layers:
        raise ValueError("gather='layer' gathers FSDP units that are decoder layers, but no decoder layer is one: "
                         "apply fully_shard to each decoder layer (accelerate: fsdp_auto_wrap_policy "
                         "TRANSFORMER_BASED_WRAP)")
    return layers


def check_same_work(work: tuple[int, ...], group: dist.ProcessGroup | None = None) -> None:
    """Raise unless every rank of `group` passes the same `work` (a description of the forwards and backwards it
    is about to run, e.g. the groups' prompt and response lengths). Two all-reduces of 2 integers (min and max of
    its length and digest); every rank must call it."""
    digest = int.from_bytes(hashlib.blake2b(repr(work).encode(), digest_size=7).digest(), "little")
    mine = torch.tensor([len(work), digest], dtype=torch.int64)
    low, high = mine.clone(), mine.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(low, high):
        raise RuntimeError("gathering a layer at a time needs every process to run the same forwards and backwards, "
                           "but the processes' work differs: their layers' all-gathers would pair up wrongly. Make the "
                           "context-parallel group span every process, or gather every parameter once (gather='all')")


@contextmanager
def _block_settings(model: FSDPModule, layers: list[Any]) -> Iterator[None]:
    """A block's FSDP settings, whoever sharded the model; the model's own restored after. Every unit: no resharding
    after a forward or backward (the block reads parameters outside module forwards), no communication from the hooks
    (`sharded_compute` reduces once), zeros reduce-scattered for unused parameters, SUM reductions on gloo (no AVG; FSDP
    then divides by the world size). `layers` (gather="layer") keep FSDP's defaults instead. FSDP's root is fixed first:
    it is set lazily at the first forward through a sharded module, and the block may enter at `model.model`."""
    state = model._get_fsdp_state()
    state._lazy_init()
    states = state._state_ctx.all_states
    groups = [g for s in states for g in s._fsdp_param_groups]
    names = ("post_forward_mesh_info", "reshard_after_backward", "reduce_grads", "all_reduce_grads",
             "reduce_scatter_unused_params", "force_sum_reduction_for_comms")
    saved = [{name: getattr(g, name) for name in names} for g in groups]
    auto = [s._auto_reshard_after_forward for s in states]
    handles = []
    try:
        for group in groups:
            if group.mesh_info.mesh.device_type == "cpu":
                group.force_sum_reduction_for_comms = True
        model.set_reshard_after_forward(False)
        model.set_reshard_after_backward(False)
        model.set_requires_gradient_sync(False)
        model.set_reduce_scatter_unused_params(True)
        for layer in layers:
            layer.set_reshard_after_forward(True, recurse=False)
            layer.set_reshard_after_backward(True, recurse=False)
            layer.set_requires_gradient_sync(True, recurse=False)
            # Capture's K/V-only forwards stop inside the last layer by raising (segment.py), so FSDP's post-forward
            # hook, which reshards, does not run there: reshard such a layer from a hook that runs even then (no_grad;
            # with grad the stopped forward's graph holds the parameters until its backward's hook reshards them).
            handles.append(layer.register_forward_hook(_reshard_if_left_gathered, always_call=True))
        yield
    finally:
        for handle in handles:
            handle.remove()
        for group, values in zip(groups, saved):
            for name, value in values.items():
                setattr(group, name, value)
        for s, value in zip(states, auto):
            s._auto_reshard_after_forward = value


def _reshard_if_left_gathered(module: torch.nn.Module, args: object, output: object) -> None:
    """A layer's no_grad forward that raised leaves its parameters gathered and its FSDP state mid-forward: reshard
    (local, no collective) and mark it idle. After a normal forward FSDP's own hook has done this already."""
    assert isinstance(module, FSDPModule)
    if torch.is_grad_enabled():
        return
    state = module._get_fsdp_state()
    for group in state._fsdp_param_groups:
        if group._training_state == TrainingState.FORWARD and group.is_unsharded:
            group.reshard()
            group._training_state = TrainingState.IDLE


def _drop_unsharded_gradients(units: list[FSDPModule]) -> None:
    for group in _param_groups(units):
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
