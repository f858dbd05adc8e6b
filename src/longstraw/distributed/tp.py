"""Tensor parallelism: a model sharded with transformers' own tensor-parallel plan, its prompt state split by heads.

`tensor_parallel(model, mesh)` applies the plan transformers ships for the family (`model.tp_plan`, what
`from_pretrained(..., distributed_config=DistributedConfig(tp_size=T))` runs at load time) to a model already in
memory: q/k/v and gate/up column-wise, o and down row-wise, the embeddings and the output projection by vocabulary.
The engine is unchanged: the attention kernels see this rank's heads only, so the prompt state holds 1/T of the K/V
heads; the chunked log-prob runs `engine.tp_logprobs` on the vocabulary-split weight; the collectives sit in module
hooks, so the ranks of a tensor-parallel group run the same segments and share every prompt.

One change to transformers' plan: its `replicated_with_grad_allreduce` style (Qwen3's per-head q/k norms) all-reduces
the *accumulated* `.grad`, which double-counts from LongStraw's second backward into it on (one per micro-batch and
prompt chunk); here each backward's gradient is all-reduced before it is accumulated (`tensor_parallel`, and `adopt`
for a model transformers split at load time). Admitted families: `TP_MODEL_TYPES`, whose heads T must divide.
docs/distributed.md has the layouts and the measurements."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from longstraw.distributed.context import ContextParallel, all_reduced, check_blocks, context_blocks
from longstraw.engine.tp_check import (
    TP_MODEL_TYPES,
    check_tensor_parallel_model,
    grad_allreduce_hooked,
    is_tensor_parallel,
)

_GRAD_ALLREDUCE = "replicated_with_grad_allreduce"


def check_tensor_parallel(model: torch.nn.Module, tp: int) -> None:
    """Raise ValueError, saying what to change, unless `model` can be split over `tp` ranks by heads."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    config: Any = model.config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(model.config, "model_type", None)  # its own type: a multimodal wrapper is not its text tower
    if model_type not in TP_MODEL_TYPES:
        ships = bool(getattr(config, "base_model_tp_plan", None))
        why = ("transformers ships a tensor-parallel plan for it, which LongStraw has not verified" if ships else
               "transformers ships no tensor-parallel plan for it")
        raise ValueError(f"tensor parallelism on {model_type}: {why}. Supported: {', '.join(TP_MODEL_TYPES)}; run "
                         "it without --tp")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    if heads % tp or kv_heads % tp:
        raise ValueError(f"--tp {tp} splits attention by heads: {model_type} has {heads} query and {kv_heads} "
                         f"key/value heads, which {tp} must divide (each rank holds whole heads); use a --tp that "
                         f"divides {kv_heads}")
    if is_tensor_parallel(model) or any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError("the model is already sharded (DTensor parameters): apply tensor_parallel once, to a plain "
                         "model")


def tensor_parallel(model: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:
    """Shard `model` in place over the 1-D tensor-parallel `mesh` with transformers' plan for its family (module
    docstring). Every rank calls it with the same weights; returns the model."""
    from transformers.distributed import DistributedConfig
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    if mesh.ndim != 1:
        raise ValueError(f"tensor_parallel takes a 1-D mesh (the tensor-parallel dimension), got {mesh.ndim}-D")
    tp = mesh.size()
    check_tensor_parallel(model, tp)
    pretrained: Any = model  # a transformers PreTrainedModel (its plan methods)
    plan, _, _ = pretrained._resolve_parallel_plans(DistributedConfig(tp_size=tp))  # one entry per module / parameter
    modules = dict(model.named_modules())
    summed = [modules[name] for name, style in plan.items() if style == _GRAD_ALLREDUCE and name in modules]
    plan = {name: style for name, style in plan.items() if style != _GRAD_ALLREDUCE}
    head = pretrained.get_output_embeddings()
    tied = head is not None and head.weight is pretrained.get_input_embeddings().weight
    if tied:  # the embeddings' entry shards the shared weight by vocabulary; the head keeps its module hook
        head_name = next(n for n, m in modules.items() if m is head)
        plan.pop(f"{head_name}.weight", None)
    apply_tensor_parallelism(model, mesh, plan)
    if tied:  # sharding replaced the embeddings' Parameter: point the head at the sharded one again
        head.weight = pretrained.get_input_embeddings().weight
    for module in summed:
        _sum_gradients_over(module, mesh.get_group())
    return model


def adopt(model: torch.nn.Module) -> torch.nn.Module:
    """Make a model that transformers itself split (`from_pretrained(..., distributed_config=DistributedConfig(
    tp_size=T))`, as accelerate and TRL load one) exact under LongStraw's several backwards per group: each module with
    transformers' `replicated_with_grad_allreduce` hook gets its class's forward back, loses the post-accumulate hook
    its parameters got at a forward with grad (it would all-reduce the accumulated `.grad`), and sums each backward's
    gradient over the tensor-parallel group instead. Then `check_tensor_parallel_model`. Returns the model."""
    hooked = set(grad_allreduce_hooked(model))
    if hooked:
        mesh: Any = getattr(model, "_device_mesh", None)
        if mesh is None:
            raise ValueError("adopt: the model has transformers' tensor-parallel hooks but no `_device_mesh`: load it "
                             "with from_pretrained(..., distributed_config=DistributedConfig(tp_size=T)) or split it "
                             "with longstraw.distributed.tp.tensor_parallel")
        group = (mesh["tp"] if mesh.mesh_dim_names and "tp" in mesh.mesh_dim_names else mesh).get_group()
        for module in (m for name, m in model.named_modules() if name in hooked):
            del module.forward  # the instance attribute transformers installed: the class's forward again
            for param in module.parameters(recurse=False):
                hooks = getattr(param, "_post_accumulate_grad_hooks", None)
                if hooks:  # registered at a forward with grad: drop them (torch keeps no other handle)
                    hooks.clear()
            _sum_gradients_over(module, group)
    check_tensor_parallel_model(model)
    return model


def _sum_gradients_over(module: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """Each backward's gradient of `module`'s own parameters summed over `group` before it is accumulated. Registered on
    the parameter objects the forward sees (FSDP2 swaps in unsharded ones), once per object."""
    hooked: dict[str, torch.Tensor] = {}

    def pre_forward(mod: torch.nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():
            return
        for name, param in mod.named_parameters(recurse=False):
            if param.requires_grad and hooked.get(name) is not param:
                param.register_hook(partial(all_reduced, group=group))
                hooked[name] = param

    module.register_forward_pre_hook(pre_forward)


def tensor_parallel_layout(device_type: str, tp: int, cp: int = 1) -> tuple[DeviceMesh, DeviceMesh | None,
                                                                               ContextParallel | None]:
    """This rank's tensor-parallel mesh, FSDP2's mesh (over the ranks with this rank's t; None when that is this rank
    alone) and context-parallel group (`context_blocks`) on the world's ranks laid out as rank = (block * cp + c) * tp
    + t. Collective: every rank calls it, in the same order."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    check_blocks(world, cp, tp)
    mesh = init_device_mesh(device_type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    context = context_blocks(cp, tp) if cp > 1 else None
    return mesh["tp"], mesh["dp"] if world > tp else None, context


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """`torch.nn.utils.clip_grad_norm_` for gradients that mix DTensors of different meshes (tensor-parallel shards,
    FSDP2 shards) with plain tensors (replicated parameters, the same on every rank): each DTensor's norm is its
    global one, so the total is the single-process norm on every rank. A collective per DTensor gradient."""
    grads = [p.grad for p in params if p.grad is not None]
    squares = []
    for grad in grads:
        wide = torch.float64 if grad.dtype == torch.float64 else torch.float32
        norm = torch.linalg.vector_norm(grad, 2.0, dtype=wide)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)
    total = float(torch.stack(squares).sum().sqrt()) if squares else 0.0
    coef = max_norm / (total + 1e-6)  # as torch's clip_grad_norm_
    if coef < 1.0:
        for grad in grads:
            grad.mul_(coef)
    return total
