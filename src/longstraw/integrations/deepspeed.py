"""DeepSpeed ZeRO for the TRL drop-in: LongStraw's gradient computed out of DeepSpeed's sight, then handed over.

DeepSpeed's engine owns the backward: ZeRO-2 and ZeRO-3 hang a hook on every parameter's gradient accumulation that
reduces (and partitions) the gradient as it arrives, and ZeRO-3 gathers each module's partitioned parameters from
hooks on its forward and backward. `backward_tree` makes many backward calls per micro-batch (one per replay and
prompt chunk), a different number on each process, so those hooks would issue mismatched collectives. Instead the
parameters are gathered once (`gathered`, ZeRO-3), the gradient is accumulated on plain leaves sharing their storage
(`plain_leaves`), and `hand_over` returns it inside a loss that Trainer backpropagates through `engine.backward`, so
DeepSpeed reduces, averages, partitions and steps as it does for TRL's own loss.

Memory: ZeRO-3 holds the full parameters during the micro-batch (as `sharded_compute` does for FSDP2); every stage
holds the full gradient of the micro-batch until it is handed over. DeepSpeed's own partitioning still applies to
the optimizer state (ZeRO-1), the reduced gradients (ZeRO-2) and the parameters at rest (ZeRO-3)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch


@contextmanager
def gathered(engine: Any) -> Iterator[None]:
    """ZeRO-3: every parameter all-gathered (collectively: every process enters and leaves) and the engine's module
    hooks removed for the block, restored after; other stages pass through."""
    if int(engine.zero_optimization_stage()) < 3:
        yield
        return
    import deepspeed
    from trl.models.utils import add_hooks, remove_hooks

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        remove_hooks(engine)
        try:
            yield
        finally:
            add_hooks(engine)


@contextmanager
def plain_leaves(model: torch.nn.Module) -> Iterator[dict[int, torch.Tensor]]:
    """Each trainable parameter of `model` replaced, in every module that holds it (tied weights: one leaf for
    both), by a leaf tensor sharing its storage; yields {id(parameter): leaf}. The parameters are put back on exit,
    the leaves keep the gradient the block accumulated."""
    leaves: dict[int, torch.Tensor] = {}
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
    try:
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is None or not param.requires_grad:
                    continue
                if id(param) not in leaves:
                    leaves[id(param)] = param.detach().requires_grad_(True)
                swapped.append((module, name, param))
                # a plain tensor in the parameter slot: nn.Module's attribute lookup returns it as the parameter
                module._parameters[name] = leaves[id(param)]  # type: ignore[assignment]
        yield leaves
    finally:
        for module, name, param in swapped:
            module._parameters[name] = param


class _HandOver(torch.autograd.Function):
    """Forward: the loss value. Backward: the precomputed gradient of each parameter input (scaled by the incoming
    gradient, 1 under Trainer), so that whatever DeepSpeed hangs on their accumulation sees TRL's gradient. ZeRO-3
    has partitioned the parameters again by then, and autograd accumulates only into a parameter of the gradient's
    shape: the backward gathers them and queues their partitioning for after DeepSpeed's hooks reduced the gradients."""

    @staticmethod
    def forward(ctx: Any, total: torch.Tensor, grads: Sequence[torch.Tensor], *params: torch.Tensor) -> torch.Tensor:
        ctx.grads, ctx.params = grads, params
        return total.clone()

    @staticmethod
    def backward(ctx: Any, out: torch.Tensor) -> tuple[Any, ...]:
        params = [p for p in ctx.params if hasattr(p, "ds_status")]
        if params:  # ZeRO-3
            params[0].all_gather(param_list=params)
            torch.autograd.Variable._execution_engine.queue_callback(lambda: params[0].partition(param_list=params))
        scale = None if bool(out == 1) else out
        grads = ctx.grads if scale is None else [g * scale for g in ctx.grads]
        ctx.grads = None
        return (None, None, *grads)


def hand_over(total: float, params: Sequence[torch.nn.Parameter], grads: Sequence[torch.Tensor],
              device: torch.device) -> torch.Tensor:
    """A scalar equal to `total` whose backward accumulates `grads[i]` into `params[i]` (each process hands over
    every trainable parameter's gradient, zeros where it has none, so that DeepSpeed's reductions pair up)."""
    return _HandOver.apply(torch.tensor(float(total), device=device), list(grads), *params)
